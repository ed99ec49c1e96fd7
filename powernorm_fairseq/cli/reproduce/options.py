"""The command's flags, and every check made before anything is written or submitted."""

import os
import subprocess
from pathlib import Path

from ...common.flags import ArgumentParser, at_least
from ..launcher import add_flags, check_flags, parse_args  # noqa: F401 (parse_args: the command's)
from . import jobs, rows
from .runs import ReproduceError, code_version, data_digest, registry


def parser():
    p = ArgumentParser(prog="reproduce.sh", description="A table of the PowerNorm paper (or another config "
                       "family) with one command: every row x seed trained with train.sh and scored with "
                       "evaluate.sh, here or on a SLURM cluster, then the table (docs/reproduce.md).")
    p.add_argument("--table", choices=rows.TABLES, help="the config family: configs/<table>-*.sh (required, "
                   "but with --report)")
    p.add_argument("--rows", nargs="+", metavar="ROW", help="configs by their suffix, the baseline first "
                   "(default: every row, the LayerNorm ones first)")
    p.add_argument("--average", type=at_least(1, "--average"), metavar="N", help="epoch checkpoints each "
                   "translation run averages (default: the row's, 10 as the paper's text; 5 as the authors' "
                   "IWSLT14 script); part of the settings, named in the table")
    p.add_argument("--out", help="runs/, table.md, table.json, the figures (default: runs/reproduce-<table>)")
    p.add_argument("--data", help="binarized data (default: data-bin/<dataset>/bin, as train.sh)")
    p.add_argument("--dry-run", action="store_true", help="print every run's commands (and job scripts), and "
                   "write or submit nothing")
    p.add_argument("--report", action="store_true", help="with --out alone: write OUT's table and figures "
                   "again from what has finished there, training, scoring and submitting nothing (OUT's table.json "
                   "names the table, its rows, seeds and flags)")
    add_flags(p, seeds=[1, 2, 3], unit="training")
    p.usage = ("reproduce.sh --table TABLE [--rows ROW...] [--seeds N...] [--out DIR] [--data DIR] "
               "[--launcher local|slurm] [SLURM flags] [--dry-run] [-- FAIRSEQ-TRAIN FLAGS...]\n"
               "       reproduce.sh --out DIR --report")
    p.epilog = "After --: more fairseq-train flags, given to every run (and part of its settings)."
    return p


def check(args, p):
    """Every refusal, in one line, before anything is written or submitted (``p.error``, or ReproduceError)."""
    if args.table is None:
        p.error("the following arguments are required: --table (or --out DIR --report)")
    known = rows.names(args.table)
    for name in args.rows or []:
        if name not in known:
            p.error(f"--rows: {name!r} is not a row of --table {args.table}; choose from {', '.join(known)}")
    if args.rows and len(set(args.rows)) != len(args.rows) or len(set(args.seeds)) != len(args.seeds):
        p.error("--rows and --seeds: a value listed twice")
    args.rows = [rows.row(args.table, name) for name in args.rows or known]
    check_flags(args, p)
    if args.average is not None and args.rows[0].lm:
        p.error("--average: the language model tables score checkpoint_best.pt, not an average; leave it out")
    args.out = Path(args.out or f"runs/reproduce-{args.table}").resolve()
    _check_out(args, p)
    _check_data(args, p)
    os.environ.pop("POWERNORM_REGISTRY", None)
    os.environ["POWERNORM_REGISTRY"] = registry()  # every script this command starts, jobs too, reads it here
    args.code_version = code_version()
    args.data_digest = data_digest(args.data) if args.prepared else None
    _check_fairseq_flags(args, p)


def _check_out(args, p):
    out = args.out
    if out.exists() and not out.is_dir():
        p.error(f"--out {out}: is a file, not a directory; give another --out")
    existing = next(d for d in [out, *out.parents] if d.exists())
    if not args.dry_run and not _writable(existing):
        p.error(f"--out {out}: cannot be written ({existing} is read-only or not ours); give another --out")


def _writable(directory):
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def _check_data(args, p):
    datasets = {row.dataset for row in args.rows}
    args.data = Path(args.data or f"data-bin/{sorted(datasets)[0]}/bin").resolve()
    dictionary = "dict.txt" if args.rows[0].lm else "dict.en.txt"
    test = "test.bin" if args.rows[0].lm else "test.*.bin"
    args.prepared = (args.data / dictionary).is_file() and bool(list(args.data.glob(test)))
    if not args.prepared and not args.dry_run:
        p.error(f"--data {args.data}: no binarized data with a test set (no {dictionary} or {test}); prepare it "
                "with data-prep/ first, or pass --data")


class _FairseqUsage(Exception):
    pass


def workers(args):
    """(GPUs per worker's script, world size) of a training of this command's launcher."""
    if args.launcher == "slurm":
        world, per_task = jobs.shape(args)
        return per_task, world
    import torch

    gpus = torch.cuda.device_count()
    return gpus, max(gpus, 1)


def _check_fairseq_flags(args, p):
    """Each row's training command, as train.sh builds it for this launcher's workers, through
    fairseq-train's own parser and the plugin's model checks: a typo after ``--`` is one line here, not a
    failed job later; so is a flag after ``--`` that would make the run another experiment than its row
    (:func:`defining`), and flags that leave fewer epoch checkpoints than the run averages. Sets
    ``args.facts``: each row's batch per update, world size and averaged checkpoints."""
    import argparse as stock
    import shlex

    from fairseq import options
    from fairseq.models import ARCH_MODEL_REGISTRY

    from ...common.errors import PowerNormConfigError
    from ...models.options import check_args
    from .runs import fairseq_command

    def error(self, message):
        from ...patches.errors import usage_message

        raise _FairseqUsage(usage_message(self, message))

    gpus, world = workers(args)
    args.facts = {}
    before = stock.ArgumentParser.error
    stock.ArgumentParser.error = error
    try:
        for row in args.rows:
            argv = shlex.split(fairseq_command(args, row, args.seeds[0], gpus,
                                               world if args.launcher == "slurm" else None))[1:]
            try:
                fairseq = options.get_training_parser()
                parsed = options.parse_args_and_arch(fairseq, argv)  # adds the model's flags to the parser
                check_args(parsed, tuple(ARCH_MODEL_REGISTRY[parsed.arch].NORM_FLAGS))
            except _FairseqUsage as err:
                raise ReproduceError(f"fairseq-train (the flags after --): {err}") from None
            except PowerNormConfigError as err:
                raise ReproduceError(f"row {row.name}: {err}") from None
            _refuse_defining(args.fairseq, defining(row, fairseq), fairseq)
            args.facts[row.name] = facts = {
                "tokens per update": parsed.max_tokens * parsed.update_freq[0] * parsed.distributed_world_size,
                "world size": parsed.distributed_world_size,
                "average": None if row.lm else parsed.keep_last_epochs}
            if not row.lm:
                _check_epochs(args, row, parsed, facts)
    finally:
        stock.ArgumentParser.error = before


#: what the launcher sets in every run, by fairseq-train's dest, and which of this command's options does it
LAUNCHER = {
    "seed": "the runs' seeds are reproduce.sh's --seeds",
    "save_dir": "each run's directory is OUT/runs/<row>-seed<N>: give --out",
    "restore_file": "each run resumes its own checkpoint in OUT/runs/<row>-seed<N>",
    "finetune_from_model": "each run trains from scratch, as its row",
    "user_dir": "every run loads this plugin", "arch": "the row's recipe sets it", "task": "the row's recipe sets it",
    "keep_last_epochs": "the epoch checkpoints a run keeps are those it averages: give reproduce.sh --average N",
    "update_freq": "the batch per update is the row's for any number of workers (train.sh sets the update "
                   "frequency)",
    "cpu": "the launcher's devices: --launcher slurm --gpus-per-node G, or the GPUs of this machine",
    "norm_sync": "more than one worker synchronises the norms' batch statistics (--norm-sync batch)",
}
DISTRIBUTED = "the workers are the launcher's: --launcher slurm with --nodes N, --tasks-per-node T, --gpus-per-node G"
ROW = "the row sets it (configs/{config}); choose rows with --rows, or add a config of your own"


def defining(row, parser):
    """{dest: why it is refused after ``--``} of every fairseq-train flag that would make a run another
    experiment than the one its row and the launcher name: the launcher's (:data:`LAUNCHER`), every field of
    fairseq's distributed-training config, every norm kind and placement flag of the plugin (the row's
    label), and every flag the row's config adds (its ``EXTRA``)."""
    import dataclasses

    from fairseq.dataclass.configs import DistributedTrainingConfig

    from ...models.options import NormConfig, _sublayer_kind
    from ...norms import NORM_TYPES
    from ...norms.placement import PLACEMENTS

    refused = dict(LAUNCHER)
    refused.update({f.name: DISTRIBUTED for f in dataclasses.fields(DistributedTrainingConfig)})
    row_says = ROW.format(config=row.config.name)
    for f in dataclasses.fields(NormConfig):
        how = f.metadata.get("argparse", {})
        if how.get("type") is _sublayer_kind or how.get("choices") in (tuple(NORM_TYPES), tuple(PLACEMENTS),
                                                                      list(NORM_TYPES), list(PLACEMENTS)):
            refused[f.name] = row_says
    extra = subprocess.run(["bash", "-c", 'source "$1" && printf "%s\\0" "${EXTRA[@]+"${EXTRA[@]}"}"', "_",
                            str(row.config)], capture_output=True, text=True, check=True).stdout.split("\0")
    for flag in extra:
        action = _action(parser, flag)
        if action is not None:
            refused[action.dest] = row_says
    refused.pop("help", None)
    return refused


def _action(parser, token):
    """The parser's action a ``--flag`` or ``--flag=value`` token sets, or None."""
    if not token.startswith("--"):
        return None
    return parser._option_string_actions.get(token.split("=", 1)[0])


def _refuse_defining(flags, refused, parser):
    for token in flags:
        action = _action(parser, token)
        if action is not None and action.dest in refused:
            raise ReproduceError(f"-- {token.split('=', 1)[0]}: refused after --, as it would make the runs "
                                 f"another experiment than their rows: {refused[action.dest]}")


def _check_epochs(args, row, parsed, facts):
    """Refuse flags that leave fewer epoch checkpoints than the run averages (what can be known before
    training: the epochs to train, the checkpoints kept, and an upper bound on the epochs --max-update
    allows, from the training set's size)."""
    average = facts["average"]
    fix = "give reproduce.sh --average N with N at most that, or train longer"
    if parsed.no_save or parsed.no_epoch_checkpoints:
        raise ReproduceError(f"row {row.name}: --no-save / --no-epoch-checkpoints after -- leave no epoch "
                             f"checkpoint to average ({average} averaged); leave them out")
    if parsed.max_epoch and parsed.max_epoch // parsed.save_interval < average:
        raise ReproduceError(f"row {row.name}: -- --max-epoch {parsed.max_epoch} leaves "
                             f"{parsed.max_epoch // parsed.save_interval} epoch checkpoint(s), and the run averages "
                             f"{average}; {fix}")
    if parsed.max_update and args.prepared:
        tokens = _train_tokens(args.data, parsed)
        most = parsed.max_update * facts["tokens per update"] / tokens if tokens else None
        if most is not None and most // parsed.save_interval < average:
            raise ReproduceError(f"row {row.name}: -- --max-update {parsed.max_update} allows at most "
                                 f"{int(most // parsed.save_interval)} epoch checkpoint(s) of "
                                 f"{tokens:,} training tokens at {facts['tokens per update']:,} tokens per "
                                 f"update, and the run averages {average}; {fix}")


def _train_tokens(data, parsed):
    """The training set's tokens as fairseq batches them (each pair its longer side), or None."""
    import numpy as np
    from fairseq.data import data_utils

    src, tgt = parsed.source_lang, parsed.target_lang
    if not (src and tgt):
        src, tgt = data_utils.infer_language_pair(str(data))
    sides = []
    for lang in (src, tgt):
        prefix = Path(data, f"train.{src}-{tgt}.{lang}")
        dataset = data_utils.load_indexed_dataset(str(prefix), None, dataset_impl=parsed.dataset_impl)
        if dataset is None:
            return None
        sides.append(np.array(dataset.sizes))  # a copy: the sizes are a view of the file, closed with dataset

    return int(np.maximum(*sides).sum())


def check_report(args, p):
    """``--report``: OUT's table.json read back into the settings its table was written with; every other
    flag refused in one line."""
    import json

    from ...common.errors import InputFileError
    from ...common.files import check_regular_file

    given = [f"--{k.replace('_', '-')}" for k, v in vars(args).items()
             if k not in ("out", "report", "fairseq", "seeds", "launcher") and v not in (None, False, [])]
    if given or args.fairseq or args.seeds != [1, 2, 3] or args.launcher != "local":
        p.error(f"--report: give --out alone (OUT's table.json has the rest){', not ' + given[0] if given else ''}")
    if not args.out:
        p.error("--report: give --out, the directory whose table to write again")
    args.out = Path(args.out).resolve()
    try:
        check_regular_file(args.out / "table.json", "table")
        saved = json.loads((args.out / "table.json").read_text())
        args.table, args.seeds = saved["table"], [int(s) for s in saved["seeds"]]
        args.rows = [rows.row(args.table, r["row"]) for r in saved["rows"]]
        args.data, args.code_version, args.fairseq = saved["data"], saved["code"], saved["fairseq-train flags"]
        args.facts = {r["row"]: {"tokens per update": r["tokens per update"], "average": r["averaged checkpoints"]}
                      for r in saved["rows"]}
    except InputFileError as err:
        p.error(f"--report: {err}; run the table's command once")
    except (OSError, ValueError, KeyError, TypeError) as err:
        p.error(f"--report: {args.out}/table.json: not a table this command wrote ({type(err).__name__}: {err}); "
                "run the table's command once")
