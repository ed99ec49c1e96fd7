"""One cell: its probe at init, fairseq's trainer (resumable), and its result.json."""

import copy
import json
import logging
import math
import re
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from ...common.files import atomic_path
from ..layout import Out
from .grid import LOSS, METRIC, StudyError, train_argv
from .out import read_probe, read_result, record_settings, wants_landscape
from .probe import initial_probe, measure_landscape

RECORD = re.compile(r"\| (train_inner|train|valid) \| (\{.*\})\s*$")
logger = logging.getLogger("powernorm_fairseq.study")


def parse(argv):
    from fairseq import options

    parser = options.get_training_parser()
    return options.parse_args_and_arch(parser, argv)


def read_log(path):
    """The train_inner, train (epoch) and valid records of a cell's log."""
    records = defaultdict(list)
    if not path.is_file():  # not written yet (nor anything else in its place: a FIFO is never opened)
        return records
    for line in path.read_text(errors="replace").splitlines():
        m = RECORD.search(line)
        if m:
            values = {}
            for k, v in json.loads(m.group(2)).items():
                try:
                    values[k.split("_", 1)[1] if k.startswith(m.group(1) + "_") else k] = float(v)
                except (TypeError, ValueError):
                    pass
            records[m.group(1)].append(values)
    return records


def run_cell(args, cell, verbose=False):
    """Probe, train and (``--landscape``) probe the landscape of one cell; its
    ``result.json``. Returns None when another process holds the cell."""
    import torch

    root = Out(args.out).cell(cell["name"])
    root.mkdir(parents=True, exist_ok=True)
    held = FileLock(root / ".lock", preserve_lock_file=True)
    try:
        held.acquire(timeout=0)
    except Timeout:
        return None
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        result = read_result(root)
        if result is not None:
            if not wants_landscape(args, result):
                return result
            return measure_landscape(args, cell, root, result)
        start = time.time() - earlier_seconds(root)  # a requeued cell's seconds count every job's
        cfg = configuration(parse(train_argv(args, cell, root)))
        record_settings(args)
        probe = read_probe(args, cell)
        if probe is None:  # not measured yet, or removed or cut short since: measured (again)
            probe = initial_probe(copy.deepcopy(cfg), LOSS[args.task])
            with atomic_path(root / "init.json") as tmp:
                Path(tmp).write_text(json.dumps(probe, indent=1))
        status = train(cfg, root / "train.log", verbose)
        result = dict(cell, status=status, initial_loss=probe["loss"], seconds=round(time.time() - start, 1))
        if status == "finished":  # the numbers saved with the last checkpoint, not a log a kill may have cut
            end = end_of_run(root / "checkpoint_last.pt")
            result["final_loss"] = end["train"].get(LOSS[args.task], float("nan"))
            result["metric"] = end["valid"].get(METRIC[args.task][0], float("nan"))
            result["updates"] = end["updates"]
        else:
            records = read_log(root / "train.log")
            result["final_loss"] = result["metric"] = float("nan")
            result["updates"] = int(max([r.get("num_updates", 0) for r in records["train_inner"] + records["train"]],
                                        default=0))
        result["converged"] = converged(result["final_loss"], result["initial_loss"], args.majority_loss,
                                        args.converged_fraction)
        if wants_landscape(args, result):
            return measure_landscape(args, cell, root, result)
        with atomic_path(root / "result.json") as tmp:
            Path(tmp).write_text(json.dumps(result, indent=1))
        return result
    finally:
        held.release()


#: the seconds a cell's earlier jobs trained before they were requeued (plain text)
EARLIER = "earlier-seconds"


def add_seconds(root, seconds):
    """Add ``seconds`` (a job about to be requeued) to the cell's earlier time."""
    with atomic_path(Path(root, EARLIER)) as tmp:
        Path(tmp).write_text(f"{earlier_seconds(root) + seconds:.1f}\n")


def earlier_seconds(root) -> float:
    path = Path(root, EARLIER)
    try:
        return float(path.read_text()) if path.is_file() else 0.0
    except (OSError, ValueError):
        return 0.0


def converged(final, initial, majority, frac):
    return bool(math.isfinite(final) and final < frac * initial and final < majority)


def configuration(train_args):
    """fairseq's configuration of parsed fairseq-train flags, made once per cell: its probe takes a copy
    (hydra's composition took some 0.3 s a time)."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    return convert_namespace_to_omegaconf(train_args)


def train(cfg, log_path, verbose):
    """fairseq's trainer on configuration ``cfg``, its log (fairseq's console lines) to ``log_path``:
    "finished", or "diverged" when fairseq stops on a non-finite gradient.
    It runs in this process, or (``--distributed-world-size`` N > 1) in the N
    processes fairseq spawns, each through :func:`_main`."""
    from fairseq import distributed_utils

    diverged = Path(log_path).with_name(".diverged")
    diverged.unlink(missing_ok=True)
    distributed_utils.call_main(cfg, _main, log_path=str(log_path), verbose=verbose)
    return "diverged" if diverged.exists() else "finished"


def _main(cfg, log_path, verbose):
    """fairseq-train's main in one process of a cell: its log to ``log_path``,
    the end-of-run record in every checkpoint, and a run that fairseq stops
    on a non-finite gradient marked diverged (``.diverged`` beside the log)."""
    from fairseq import distributed_utils
    from fairseq_cli import train as fairseq_train

    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                                           "%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    console = [h for h in root.handlers if isinstance(h, logging.StreamHandler)
               and not isinstance(h, logging.FileHandler)]
    levels, root_level = [h.level for h in console], root.level
    root.addHandler(handler)
    if distributed_utils.is_master(cfg.distributed_training):  # the other workers' records once, not N times
        root.setLevel(logging.INFO)
    else:
        handler.setLevel(logging.WARNING)
    for h in console:
        h.setLevel(logging.INFO if verbose else logging.WARNING)
    try:
        with end_of_run_records():
            fairseq_train.main(cfg)
    except SystemExit as end:  # the plugin ends a run that resumes with nothing left to train
        if end.code not in (0, None):
            raise
    except Exception as err:  # fairseq's NaN detector may fail while it reports the FloatingPointError
        cause = err
        while cause is not None and not isinstance(cause, FloatingPointError):
            cause = cause.__context__
        if cause is None:
            raise
        logger.info("diverged: %s", cause)
        Path(log_path).with_name(".diverged").touch()
    finally:
        root.removeHandler(handler)
        root.setLevel(root_level)
        handler.close()
        for h, level in zip(console, levels):
            h.setLevel(level)


def numbers(stats):
    out = {}
    for key, value in stats.items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            pass
    return out


@contextmanager
def end_of_run_records():
    """Each checkpoint fairseq saves holds, in its ``extra_state["study"]``,
    the training numbers of the epoch so far (what the epoch's ``| train |``
    line prints after the save), the last validation's and the update count:
    the end of a run is read from its last checkpoint, which fairseq renames
    into place whole, and never from a log that a kill between the save and
    the line would leave one epoch short."""
    from fairseq.logging import metrics
    from fairseq.trainer import Trainer
    from fairseq_cli import train as fairseq_train

    save, valid_stats, last_valid = Trainer.save_checkpoint, fairseq_train.get_valid_stats, {}

    def get_valid_stats(*args, **kwargs):
        stats = valid_stats(*args, **kwargs)
        last_valid.clear()
        last_valid.update(numbers(stats))
        return stats

    def save_checkpoint(self, filename, extra_state):
        extra_state["study"] = dict(updates=self.get_num_updates(), valid=dict(last_valid),
                                    train=numbers(metrics.get_smoothed_values("train")))
        return save(self, filename, extra_state)

    Trainer.save_checkpoint, fairseq_train.get_valid_stats = save_checkpoint, get_valid_stats
    try:
        yield
    finally:
        Trainer.save_checkpoint, fairseq_train.get_valid_stats = save, valid_stats


def end_of_run(checkpoint):
    """The end-of-run record of a finished cell's last checkpoint."""
    from ...common.checkpoints import load

    record = (load(str(checkpoint)).get("extra_state") or {}).get("study")
    if not record:
        raise StudyError(f"{checkpoint}: holds no end-of-run record (saved by an earlier version of the study); "
                         f"remove {checkpoint.parent} to train the cell again")
    return record
