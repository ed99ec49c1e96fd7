"""Average the last N checkpoints of a fairseq run: ``powernorm-average``.

Floating-point entries of the model's state dict are averaged: parameters
*and* the running statistics of BN, PN-V and PN (psi^2, nu), so the averaged
model normalises with the mean of the statistics its weights were trained
with. Integer buffers (PN's step counter) are taken from the newest
checkpoint. Everything else (configuration, optimizer history) is the newest
checkpoint's. The output is written to a temporary file and renamed, so an
interrupted run never leaves a half-written checkpoint.
"""

import argparse
import os
import re
import sys
from pathlib import Path

import torch

from .checkpoints import allow_fairseq_checkpoints
from .files import atomic_path

PATTERNS = {"epoch": re.compile(r"checkpoint(\d+)\.pt"), "update": re.compile(r"checkpoint_\d+_(\d+)\.pt")}


def last_checkpoints(directory, n, kind="epoch", upper_bound=None):
    """Paths of the newest ``n`` epoch (``checkpointE.pt``) or update
    (``checkpoint_E_U.pt``) checkpoints in ``directory``, newest first."""
    found = []
    for path in Path(directory).iterdir():
        match = PATTERNS[kind].fullmatch(path.name)
        if match and (upper_bound is None or int(match.group(1)) <= upper_bound):
            found.append((int(match.group(1)), path))
    if len(found) < n:
        raise ValueError(f"{directory} has {len(found)} {kind} checkpoints, {n} requested")
    return [path for _, path in sorted(found, reverse=True)[:n]]


def average_checkpoints(paths):
    """The newest checkpoint's state with the model entries averaged over ``paths``."""
    allow_fairseq_checkpoints()
    states = [torch.load(p, map_location="cpu", weights_only=True) for p in paths]
    keys = list(states[0]["model"])
    for path, state in zip(paths, states):
        if list(state["model"]) != keys:
            raise ValueError(f"{path} has other model entries than {paths[0]}")
    averaged = {}
    for key in keys:
        values = [s["model"][key] for s in states]
        if values[0].is_floating_point():
            averaged[key] = torch.stack([v.double() for v in values]).mean(0).to(values[0].dtype)
        else:
            averaged[key] = values[0].clone()
    newest = max(zip(paths, states), key=lambda ps: os.path.getmtime(ps[0]))[1]
    return {**newest, "model": averaged}


def save_atomically(state, output):
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(output) as tmp:
        torch.save(state, tmp)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="powernorm-average",
        description="Average model parameters and running statistics of fairseq checkpoints.")
    parser.add_argument("--inputs", nargs="+", required=True,
                        help="checkpoint files, or one directory with --num-*-checkpoints")
    parser.add_argument("--output", required=True, help="the averaged checkpoint to write")
    count = parser.add_mutually_exclusive_group()
    count.add_argument("--num-epoch-checkpoints", type=int, metavar="N",
                       help="average the last N checkpointE.pt files of the directory")
    count.add_argument("--num-update-checkpoints", type=int, metavar="N",
                       help="average the last N checkpoint_E_U.pt files of the directory")
    parser.add_argument("--checkpoint-upper-bound", type=int, metavar="K",
                        help="ignore checkpoints after epoch (or update) K")
    args = parser.parse_args(argv)

    n = args.num_epoch_checkpoints or args.num_update_checkpoints
    if n is not None:
        if n < 1:
            parser.error("--num-*-checkpoints must be >= 1")
        if len(args.inputs) != 1 or not Path(args.inputs[0]).is_dir():
            parser.error("--num-*-checkpoints needs exactly one directory in --inputs")
        kind = "epoch" if args.num_epoch_checkpoints else "update"
        try:
            paths = last_checkpoints(args.inputs[0], n, kind, args.checkpoint_upper_bound)
        except ValueError as err:
            parser.error(str(err))
    else:
        if args.checkpoint_upper_bound is not None:
            parser.error("--checkpoint-upper-bound needs --num-epoch-checkpoints or --num-update-checkpoints")
        paths = [Path(p) for p in args.inputs]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            parser.error(f"no such checkpoint: {', '.join(missing)}")
    save_atomically(average_checkpoints(paths), args.output)
    names = ", ".join(p.name for p in paths)
    print(f"averaged {len(paths)} checkpoints ({names}): parameters and running statistics "
          f"-> {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
