"""Argument types shared by the plugin's flags and its console scripts."""

import argparse


def at_least(minimum: int, flag: str = None):
    """An integer >= ``minimum``; the error names ``flag`` when given."""
    def parse(text):
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{flag + ' ' if flag else ''}must be >= {minimum}, got {text}")
        return value

    return parse
