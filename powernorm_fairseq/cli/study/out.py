"""The study's directory, OUT: writable, one set of training settings, and the results on disk."""

import json
import math
import tempfile
from pathlib import Path

from ..layout import Out
from ...common.files import atomic_path


def writable_out(args, p):
    """OUT made, or one line saying why it cannot be, before anything is written there."""
    out = args.out
    if out.exists() and not out.is_dir():
        p.error(f"--out {out}: is a file, not a directory; give a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        p.error(f"--out {out}: cannot write there ({err.strerror or err}); give a writable directory")


#: what every cell of one OUT must share (the grid's lists may grow between runs)
SETTINGS = ("task", "optimizer", "placement", "warmup_updates", "max_epochs", "max_update", "batch_size",
            "max_tokens", "converged_fraction")


def settings(args):
    mine = {key: getattr(args, key) for key in SETTINGS}
    mine["fairseq_args"] = args.fairseq
    mine["data"] = str(args.data)
    if args.launcher == "slurm" and args.gpus_per_node > 1:  # data-parallel cells see a larger batch
        mine["workers_per_cell"] = args.gpus_per_node
    return mine


def trained_any(out):
    """Whether a cell of OUT holds what training made: a checkpoint or a result."""
    return any(Out(out).cells.glob("*/checkpoint*.pt")) or any(Out(out).cells.glob("*/result.json"))


def same_settings(args, p):
    """OUT/settings.json holds the training settings of the cells trained
    there; a rerun with others would mix cells trained two ways, and is
    refused. Settings that no cell trained with yet (a start that failed)
    bind nothing: the probes they made are removed, and the new settings
    are recorded when a cell starts (:func:`record_settings`)."""
    path = Path(args.out, "settings.json")
    if not path.is_file():
        return
    mine, theirs = settings(args), json.loads(path.read_text())
    differ = [k for k in {**theirs, **mine} if theirs.get(k) != mine.get(k)]
    if not differ:
        return
    if trained_any(args.out):
        k = differ[0]
        p.error(f"--out {args.out} holds a study run with {k.replace('_', '-')} {theirs.get(k)!r}, not "
                f"{mine.get(k)!r}: rerun it with its settings, or give another --out")
    for probe in Out(args.out).cells.glob("*/init.json"):
        probe.unlink()
    path.unlink()


def record_settings(args):
    """settings.json, written when a cell starts."""
    path = Path(args.out, "settings.json")
    mine = settings(args)
    if not path.is_file() or json.loads(path.read_text()) != mine:
        with atomic_path(path) as tmp:
            Path(tmp).write_text(json.dumps(mine, indent=1))


def finished(args, members):
    """{name: result} of the finished cells among ``members``, each result.json read once."""
    done = {}
    for cell in members:
        result = read_result(Out(args.out).cell(cell["name"]))
        if result is not None and not wants_landscape(args, result):
            done[cell["name"]] = result
    return done


def _record(path, key):
    """The JSON object in ``path`` if it is a regular file holding one with ``key``, else None
    (missing, cut short or edited: the caller measures or runs it again)."""
    try:
        record = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and key in record else None


def read_result(root):
    """A cell's result.json (``root``: its folder), or None when it is missing or
    unreadable (cut short, or edited): such a cell is run again, and resumes."""
    return _record(Path(root, "result.json"), "status")


def read_probe(args, cell):
    """A cell's init.json, or None when it is missing or unreadable."""
    probe = _record(Path(Out(args.out).cell(cell["name"]), "init.json"), "grad_norms")
    return probe if probe is None or isinstance(probe["grad_norms"], dict) else None


def wants_landscape(args, result):
    return args.landscape and "lipschitz" not in result and result["status"] == "finished" \
        and math.isfinite(result["final_loss"])
