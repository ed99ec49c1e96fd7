"""Reading fairseq checkpoints safely under torch >= 2.6.

torch.load defaults to ``weights_only=True`` since torch 2.6, and a fairseq
checkpoint holds its training configuration as an ``argparse.Namespace``
(legacy ``args``) next to the weights. Allowing exactly the types fairseq
writes keeps the safe loader on while ``fairseq-generate``,
``fairseq-interactive``, resume and checkpoint averaging work unchanged.
"""

import argparse
import pickle
import re
import zipfile

import torch

from .errors import InputFileError
from .files import check_regular_file

SAFE_GLOBALS = [argparse.Namespace]
#: what torch.load raises on a file that is no (complete) checkpoint
UNREADABLE = (pickle.UnpicklingError, RuntimeError, EOFError, IndexError, KeyError, ValueError, TypeError,
              AttributeError, UnicodeDecodeError, zipfile.BadZipFile)


def allow_fairseq_checkpoints():
    torch.serialization.add_safe_globals(SAFE_GLOBALS)


def refused(exc: BaseException) -> bool:
    """Whether torch.load's weights-only loader refused a pickle for a global it
    does not allow (code), rather than failing on a truncated file: torch names
    the pickle opcode, GLOBAL, in either wording it has used ("Unsupported
    global: GLOBAL x" and "unsupported GLOBAL x whose module is blocked")."""
    return isinstance(exc, pickle.UnpicklingError) and re.search(r"\bGLOBAL\b", str(exc)) is not None


def unsafe_globals(path, exc: BaseException) -> list:
    """The globals a refused checkpoint holds beyond what the weights-only
    loader reads: all of them for torch's zip format
    (``get_unsafe_globals_in_checkpoint``), else the one torch's refusal names."""
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # a legacy or plain pickle file: torch lists only zip checkpoints
        found = []
    found = [name for name in found if name != "argparse.Namespace"]
    return found or re.findall(r"\bGLOBAL ([\w.]+)", str(exc))[:1]


def why_unreadable(path, exc: BaseException) -> str:
    """One line naming ``path`` and what is wrong with it, for an exception of torch.load."""
    if refused(exc):
        names = unsafe_globals(path, exc)
        held = f" ({', '.join(names)})" if names else ""
        return (f"{path}: refused: it holds what the weights-only loader does not read{held}: objects other "
                "than tensors and a configuration, i.e. code that loading would run")
    return f"{path}: not a readable checkpoint (truncated, corrupt or another kind of file)"


def load(path):
    """A checkpoint's state, read on the CPU by torch's weights-only loader
    with fairseq's configuration type allowed: whatever else a pickle holds
    (code) is refused, as is a truncated or foreign file, in one line that
    names the file (:class:`InputFileError`)."""
    allow_fairseq_checkpoints()
    check_regular_file(path, "checkpoint")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except UNREADABLE as exc:
        raise InputFileError(why_unreadable(path, exc)) from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise InputFileError(f"{path}: not a fairseq checkpoint (no model state)")
    return state


def model_config(state):
    """A checkpoint's model flags: fairseq keeps them in ``cfg.model`` (an
    ``argparse.Namespace`` or a dict), older versions in ``args``."""
    return (state.get("cfg") or {}).get("model") or state.get("args")


def setting_of(cfg, key):
    """A flag of model flags ``cfg`` (a namespace or a dict), or None."""
    return cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)


def model_setting(state, key):
    """A model flag of a checkpoint, or None."""
    return setting_of(model_config(state), key)


def of_the_plugin(state) -> bool:
    """Whether a checkpoint is of one of this plugin's architectures."""
    return str(model_setting(state, "arch") or "").startswith("powernorm_")


def first_nonfinite(model: dict):
    """The name of the first floating-point model entry holding NaN or inf, or None."""
    for name, value in model.items():
        if torch.is_tensor(value) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return name
    return None


#: what a refusal of a non-finite checkpoint says to pass, for a post-mortem
ALLOW_NONFINITE = "--allow-nonfinite (POWERNORM_ALLOW_NONFINITE=1 for fairseq's commands)"


def check_finite(path, state, allow: bool = False):
    """Refuse, in one line naming the file and the tensor, a checkpoint whose
    model entries hold NaN or inf (a diverged run), unless ``allow``."""
    name = None if allow else first_nonfinite(state.get("model") or {})
    if name is not None:
        raise InputFileError(f"{path}: {name} holds NaN or inf (a diverged run?); load an earlier checkpoint, "
                             f"or pass {ALLOW_NONFINITE} for a post-mortem")


def updates(state) -> int:
    """The optimizer updates a checkpoint was saved after (-1 when it does not say)."""
    history = state.get("optimizer_history") or [{}]
    return int(history[-1].get("num_updates", -1))
