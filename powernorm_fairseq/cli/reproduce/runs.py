"""One run = one row x one seed, in ``OUT/runs/<row>-seed<seed>/``: its
commands (exactly what ``train.sh`` and ``evaluate.sh`` run for the row), its
state on disk, the settings it was started with, and the local launcher.

**What counts as a changed setting** (``run.json``, written when a run first
starts; a rerun that differs is refused in one line): the row's config file,
the seed, the fairseq-train flags after ``--``, the data (the file names and
sizes in ``--data``, and the content of its dictionaries and indexes) and the
code (the plugin's version and a digest of its sources and scripts; fairseq's
and torch's versions). What does not: the launcher and its resources (the
world size changes, and train.sh keeps the row's batch per update), ``--out``'s
other runs, ``--rows`` and ``--seeds`` (a table can grow). The batch per
update and the averaged checkpoints are settings (and named in the table)."""

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from ..layout import Out
from ...common.files import atomic_path, check_regular_file, last_line, tail
from .rows import ROOT, score_of

FAILURE = "failure.txt"  # why a run ended without its score, in one line; removed when it starts again
SETTINGS = "run.json"


class ReproduceError(ValueError):
    """A table, a run or an OUT this command cannot use; one line."""


def name(row, seed):
    return f"{row.name}-seed{seed}"


def directory(args, row, seed):
    return Out(args.out).run(name(row, seed))


def train_command(args, row, seed, gpus, world=None):
    """What trains the run: the row's training script, as a user would type it for this run."""
    data = ["--data", str(args.data)]
    world = ["--world-size", str(world)] if world else []
    average = ["--average", str(args.average)] if getattr(args, "average", None) else []
    return ["bash", str(row.train_script), "--config", str(row.config), "--seed", str(seed), *data,
            "--save-dir", str(directory(args, row, seed)), "--gpus", str(gpus), *world, *average, "--",
            *args.fairseq]


def fairseq_command(args, row, seed, gpus, world=None):
    """The fairseq-train command the run's training script runs (its ``--dry-run``): the batch, the update
    frequency and the distributed flags as they are."""
    command = train_command(args, row, seed, gpus, world)
    cut = command.index("--")
    dry = subprocess.run(command[:cut] + ["--dry-run"] + command[cut:], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "POWERNORM_REGISTRY": registry()})
    if dry.returncode:
        raise ReproduceError(f"row {row.name}: {(dry.stderr.strip().splitlines() or ['--dry-run failed'])[-1]}")
    return dry.stdout.strip()


def score_command(args, row, seed, gpu):
    average = [] if row.lm else ["--average", str(args.facts[row.name]["average"])]
    return ["bash", str(row.score_script), "--dataset", row.dataset, "--data", str(args.data),
            "--save-dir", str(directory(args, row, seed)), *average, *([] if gpu else ["--cpu"])]


def trained(run):
    """fairseq-train ended its run ("done training") and left its last checkpoint."""
    return Path(run, "checkpoint_last.pt").is_file() and "done training" in tail(Path(run, "train.log"), 65536)


def scored(row, run):
    """The run's score is there, readable, and of the run as it now is (newer than its checkpoint): an
    unreadable score counts as none, so that a rerun scores the run again."""
    score, checkpoint = Path(run, row.score_file), Path(run, row.scored_checkpoint)
    if not (trained(run) and score.is_file() and checkpoint.is_file()
            and score.stat().st_mtime_ns >= checkpoint.stat().st_mtime_ns):
        return False
    try:
        score_of(row, run)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False
    return True


def state(row, run):
    """("scored", (metric, sacreBLEU, signature)), ("failed", why), ("trained", ...) or ("unfinished", ...)."""
    if scored(row, run):
        return "scored", score_of(row, run)
    why = last_line(Path(run, FAILURE))
    if why:
        return "failed", why
    return ("trained", "trained, not scored") if trained(run) else ("unfinished", "unfinished")


def failed(run, why):
    Path(run).mkdir(parents=True, exist_ok=True)
    with atomic_path(Path(run, FAILURE)) as tmp:
        Path(tmp).write_text(" ".join(why.split())[:2000] + "\n")


def settings(args, row, seed):
    check_regular_file(row.config, "config")
    return {"table": row.table, "row": row.name, "seed": seed,
            "config": hashlib.sha256(row.config.read_bytes()).hexdigest()[:16],
            "fairseq-train flags": list(args.fairseq), "data": args.data_digest, "code": args.code_version,
            "tokens per update": args.facts[row.name]["tokens per update"],
            "averaged checkpoints": args.facts[row.name]["average"]}


def check_settings(args, runs):
    """Refuse, in one line, a run started with other settings than this command's."""
    for row, seed in runs:
        path = directory(args, row, seed) / SETTINGS
        if not path.exists():
            continue
        check_regular_file(path, "run record")
        try:
            then = json.loads(path.read_text())
        except (OSError, ValueError):
            raise ReproduceError(f"{path}: unreadable; remove the run's directory to start it again") from None
        now = settings(args, row, seed)
        for key, value in now.items():
            if then.get(key) != value:
                raise ReproduceError(f"{directory(args, row, seed)} was started with another {key} "
                                     f"({_difference(then.get(key), value)}); give another --out, or remove the "
                                     "run's directory to start it again")


def _difference(then, now):
    """What was, and what is: a list of flags from (one before) where they first differ."""
    import shlex

    if not (isinstance(then, list) and isinstance(now, list)):
        return f"{then}, now {now}"
    first = next((i for i, (a, b) in enumerate(zip(then, now)) if a != b), min(len(then), len(now)))
    return f"{shlex.join(then[max(first - 1, 0):]) or 'none'}, now {shlex.join(now[max(first - 1, 0):]) or 'none'}"


def orphaned(run):
    """Whether a run's directory holds files but not its run.json: it was removed (and remade by the
    training that went on writing there) after the run started. What is there is of no recorded run."""
    run = Path(run)
    return run.is_dir() and not (run / SETTINGS).exists() and any(run.iterdir())


def start_afresh(args, row, seed):
    """An orphaned run's directory removed, so that the run trains again from scratch; whether it was."""
    import shutil

    run = directory(args, row, seed)
    if not orphaned(run):
        return False
    print(f"reproduce: {name(row, seed)}: its directory lost its run.json while it trained (removed?); what is "
          "there is removed and the run trains again from scratch", file=sys.stderr)
    shutil.rmtree(run)
    return True


def record(args, row, seed):
    """The run's settings, written once, when it first starts; a previous failure forgotten. The path of
    run.json when written now, else None."""
    run = directory(args, row, seed)
    run.mkdir(parents=True, exist_ok=True)
    Path(run, FAILURE).unlink(missing_ok=True)
    if (run / SETTINGS).exists():
        return None
    # the world size is not a setting: any number of workers trains the row's batch per update
    kept = {**settings(args, row, seed), "world size": args.facts[row.name]["world size"]}
    with atomic_path(run / SETTINGS) as tmp:
        Path(tmp).write_text(json.dumps(kept, indent=1) + "\n")
    return run / SETTINGS


def data_digest(data):
    """The data as the settings see it: each file's name and size, and the content of the small ones that
    say what the binarized text is (the dictionaries and the indexes)."""
    h = hashlib.sha256()
    for path in sorted(Path(data).iterdir()):
        if path.is_file():
            h.update(f"{path.name} {path.stat().st_size}\n".encode())
            if path.suffix in (".txt", ".idx", ".model"):
                h.update(path.read_bytes())
    return h.hexdigest()[:16]


def code_version():
    """The plugin's version and a digest of its sources, kernels and scripts; fairseq's and torch's versions."""
    from importlib.metadata import version

    from ... import __version__

    h = hashlib.sha256()
    sources = [p for pattern in ("powernorm_fairseq/**/*.py", "powernorm_fairseq/**/*.h", "powernorm_fairseq/**/*.cpp",
                                 "scripts/*.sh", "scripts/*.py") for p in ROOT.glob(pattern)]
    for path in sorted(p for p in sources if p.is_file()):
        h.update(f"{path.relative_to(ROOT)}\n".encode() + path.read_bytes())
    return f"powernorm-fairseq {__version__} ({h.hexdigest()[:12]}), fairseq {version('fairseq-fixed')}, " \
           f"torch {version('torch')}"


def run_local(args, todo):
    """Train and score each run here, one after another; (row, seed) of those that failed."""
    import torch

    gpus = torch.cuda.device_count()
    failures = []
    for i, (row, seed, step) in enumerate(todo, 1):
        run = directory(args, row, seed)
        print(f"reproduce: [{i}/{len(todo)}] {name(row, seed)}: {'training' if step == 'train' else 'scoring'}",
              file=sys.stderr)
        if start_afresh(args, row, seed):
            step = "train"
        record(args, row, seed)
        if step == "train":
            why = call(train_command(args, row, seed, gpus), "training")
            if why is None and not trained(run):
                why = "training ended without fairseq's 'done training'"
            if why:
                failed(run, why)
                failures.append((row, seed))
                continue
        why = call(score_command(args, row, seed, gpus > 0), "scoring")
        if why:
            failed(run, why)
            failures.append((row, seed))
    return failures


def call(command, what, env=None, log=None):
    """Run a recipe, its output passed on to ``log`` (default: stderr); None,
    or why it failed (its last line on stderr)."""
    log = log or sys.stderr
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**(os.environ if env is None else env), "POWERNORM_REGISTRY": registry()})
    last = ""
    try:
        for line in proc.stderr:
            log.write(line)
            last = line.strip() or last
        proc.wait()
    except BaseException:  # Ctrl-C, SIGTERM, a requeue: the recipe ends first (its scripts end their children)
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        raise
    if proc.returncode == 0:
        return None
    return f"{what} failed (exit status {proc.returncode}): {last or 'no message'}"


def registry():
    """lib.sh's registry query, answered from this process (each script would import torch to ask), or
    from the command that submitted this job."""
    if os.environ.get("POWERNORM_REGISTRY"):
        return os.environ["POWERNORM_REGISTRY"]
    from ...norms import NORM_TYPES
    from ...norms.placement import PLACEMENTS
    from ...norms.qk_norm import QK_KINDS

    return "\n".join(map(" ".join, (NORM_TYPES, PLACEMENTS, QK_KINDS)))
