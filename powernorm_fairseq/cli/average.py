"""Average the last N checkpoints of a fairseq run: ``powernorm-average``.

Floating-point entries of the model's state dict are averaged: parameters
*and* the running statistics of BN, PN-V and PN (psi^2, nu), so the averaged
model normalises with the mean of the statistics its weights were trained
with. Integer buffers (PN's step counter) and everything else (configuration,
optimizer history) are those of the input with the most updates, whatever the
order of the inputs. The inputs are read one at a time into one float64
accumulator, each checked first (the same model, finite values), so memory
holds one input and the accumulator whatever their number. The output is
written to a temporary file and renamed, so an interrupted run never leaves a
half-written checkpoint.
"""

import os
import re
import sys
from pathlib import Path

import torch

from ..common import checkpoints
from ..common.errors import InputFileError
from ..common.files import atomic_path, check_regular_file, end_cleanly_on_sigterm
from ..common.flags import ArgumentParser

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


def model_settings(state) -> dict:
    """The architecture and what the model computes with (``models/settings.py``):
    inputs that differ in these are checkpoints of different models."""
    from ..models import settings

    saved = settings.snapshot(checkpoints.model_config(state))
    return {"arch": saved.get("arch"), **settings.function_settings(saved, settings.sides_of(saved.get("arch")))}


def average_checkpoints(paths, allow_nonfinite=False):
    """The state of the input with the most updates, its model's floating-point
    entries averaged over ``paths``. Checkpoints of different models are
    refused in one line (:class:`InputFileError`): the same file twice,
    another architecture or other norm settings, other entries or other
    shapes, and so is one that holds NaN or inf (unless ``allow_nonfinite``)."""
    paths = [Path(p) for p in paths]
    for i, path in enumerate(paths):
        for earlier in paths[:i]:
            if path.exists() and earlier.exists() and os.path.samefile(path, earlier):
                raise InputFileError(f"{path}: given twice (as {earlier}); average distinct checkpoints")
    sums, first, shapes, newest, inputs = {}, None, None, (None, -2), []
    for path in paths:
        state = checkpoints.load(path)
        inputs.append({"file": path.name, "updates": checkpoints.updates(state)})
        checkpoints.check_finite(path, state, allow_nonfinite)
        model = state["model"]
        if first is None:
            first, shapes = model_settings(state), {k: tuple(v.shape) for k, v in model.items()}
        else:
            settings = model_settings(state)
            differ = [f"{k}={settings.get(k)!r} (not {first.get(k)!r})" for k in dict.fromkeys([*first, *settings])
                      if settings.get(k) != first.get(k)]
            if differ:
                raise InputFileError(f"{path}: another model than {paths[0]}: {', '.join(differ)}")
            if list(model) != list(shapes):
                raise InputFileError(f"{path}: other model entries than {paths[0]}")
            for key, value in model.items():
                if tuple(value.shape) != shapes[key]:
                    raise InputFileError(f"{path}: {key} has shape {tuple(value.shape)}, {shapes[key]} in {paths[0]}")
        for key, value in model.items():
            if value.is_floating_point():
                if key in sums:
                    sums[key].add_(value)  # in float64, with no float64 copy of the input (a heap of them grows)
                else:
                    sums[key] = value.double()
        updates = checkpoints.updates(state)
        if updates > newest[1]:
            newest = (path, updates)
        del state, model  # one input at a time
    kept = checkpoints.load(newest[0])
    averaged = {key: (sums[key] / len(paths)).to(value.dtype) if key in sums else value
                for key, value in kept["model"].items()}
    return {**kept, "model": averaged, "averaged_from": inputs}  # what a score of it names (powernorm-score)


def save_atomically(state, output):
    output = Path(output)
    if output.is_dir():
        raise InputFileError(f"--output {output}: is a directory; name the checkpoint file to write")
    output.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(output) as tmp:
        torch.save(state, tmp)


def main(argv=None):
    end_cleanly_on_sigterm()
    parser = ArgumentParser(
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
    parser.add_argument("--allow-nonfinite", action="store_true",
                        help="average inputs that hold NaN or inf (refused otherwise), for a post-mortem")
    args = parser.parse_args(argv)

    def fail(message):  # one line, as the plugin's other refusals: no usage block
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    n = args.num_epoch_checkpoints or args.num_update_checkpoints
    if n is not None:
        if n < 1:
            fail("--num-*-checkpoints must be >= 1")
        if len(args.inputs) != 1 or not Path(args.inputs[0]).is_dir():
            fail("--num-*-checkpoints needs exactly one directory in --inputs")
        kind = "epoch" if args.num_epoch_checkpoints else "update"
        try:
            paths = last_checkpoints(args.inputs[0], n, kind, args.checkpoint_upper_bound)
        except ValueError as err:
            fail(str(err))
    else:
        if args.checkpoint_upper_bound is not None:
            fail("--checkpoint-upper-bound needs --num-epoch-checkpoints or --num-update-checkpoints")
        paths = [Path(p) for p in args.inputs]
        for path in paths:
            try:
                check_regular_file(path, "checkpoint")
            except InputFileError as err:
                fail(err)
    clash = [str(p) for p in paths if Path(args.output).resolve() == p.resolve()]
    if clash:
        fail(f"--output {args.output} is one of the inputs ({clash[0]}): it would be overwritten; "
                     "name another file")
    if Path(args.output).is_dir():
        fail(f"--output {args.output} is a directory: name the checkpoint file to write")
    try:
        save_atomically(average_checkpoints(paths, args.allow_nonfinite), args.output)
    except (InputFileError, OSError) as err:
        fail(err)
    names = ", ".join(p.name for p in paths)
    print(f"averaged {len(paths)} checkpoints ({names}): parameters and running statistics "
          f"-> {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
