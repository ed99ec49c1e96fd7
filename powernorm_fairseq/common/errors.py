"""The plugin's errors: each ends a command in one line naming the flag or file."""

try:  # fairseq-hydra-train runs under hydra, which prints its compact errors as their message alone
    from hydra.errors import CompactHydraException as _Compact
except ImportError:  # the norm library without fairseq
    class _Compact(Exception):
        pass


class PowerNormConfigError(ValueError, _Compact):
    """A flag value or combination this plugin cannot honour."""


class InputFileError(PowerNormConfigError):
    """A file a command cannot use; the message names it and what is wrong."""


class TrainingDiverged(FloatingPointError):
    """A training step whose gradients are not finite; the message names the update."""
