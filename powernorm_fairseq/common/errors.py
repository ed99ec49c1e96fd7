"""The plugin's errors: each ends a command in one line naming the flag or file."""


class PowerNormConfigError(ValueError):
    """A flag value or combination this plugin cannot honour."""


class InputFileError(PowerNormConfigError):
    """A file a command cannot use; the message names it and what is wrong."""
