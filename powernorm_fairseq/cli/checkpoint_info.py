"""What the analyses read of a checkpoint (``powernorm-analyze``, its landscape probe), and their error."""

import os
from pathlib import Path

from ..common import checkpoints
from ..common.errors import InputFileError


class AnalyzeError(ValueError):
    """An input this command cannot read."""


def load_checkpoint(path):
    if not os.path.exists(path):
        raise AnalyzeError(f"no such checkpoint: {path}")
    try:
        return checkpoints.load(path)
    except InputFileError as err:
        raise AnalyzeError(str(err)) from None


def checkpoint_info(state):
    """(encoder norm type, number of updates) of a checkpoint's state."""
    kind = checkpoints.model_setting(state, "norm_type") or "ln (fairseq)"
    history = state.get("optimizer_history") or [{}]
    return kind, int(history[-1].get("num_updates", 0))


def checkpoint_label(path):
    path = Path(path)
    return f"{path.resolve().parent.name}/{path.name}"
