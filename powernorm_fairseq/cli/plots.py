"""The figures' helpers every command shares (the study's, the tables', powernorm-analyze's)."""

import logging

from ..common.files import atomic_path


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display), its import's debug log silenced."""
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # before the import, which logs at DEBUG
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path, plt):
    """Write ``fig`` to ``path`` whole or not at all (a temporary file renamed), and close it."""
    try:
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=120)
    finally:
        plt.close(fig)
    return path
