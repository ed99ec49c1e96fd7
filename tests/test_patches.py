"""What importing the plugin changes, and when the changes to fairseq are installed."""

import re

import pytest

from support import ROOT, USER_DIR, cli, losses, train_args
from powernorm_fairseq import patches

pytestmark = pytest.mark.slow


def python(program):
    """``python -c program`` in a process that has imported torch alone (support's fork server)."""
    return cli("python", "-c", program, cwd=ROOT, timeout=300).stdout


@pytest.mark.parametrize("module", ["powernorm_fairseq", "powernorm_fairseq.norms", "powernorm_fairseq.cli.score",
                                    "powernorm_fairseq.cli.average", "powernorm_fairseq.cli.analyze"])
def test_the_norm_library_and_the_tools_import_without_fairseq(module):
    """Nor torch.compile's machinery: importing torch._dynamo takes seconds, in every process."""
    out = python(f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'fairseq'), "
                 "'torch._dynamo' in sys.modules)")
    assert out.split() == ["[]", "False"]


# what each patch replaces, as an expression evaluated after `import fairseq`
PATCHED = {
    "unreadable checkpoints": "fairseq.checkpoint_utils.load_checkpoint_to_cpu",
    "safe archives": "fairseq.file_utils.load_archive_file",
    "one-line errors": "sys.excepthook",
    "one-line usage errors": "argparse.ArgumentParser.error",
    "fairseq's input errors": "getattr(getattr(sys.modules.get('powernorm_fairseq.patches.errors'), "
                              "'name_fairseq_input_errors', None), 'installed', False)",
    "atomic copies": "fairseq.file_io.PathManager.copy",
    "exact resume": "fairseq.tasks.FairseqTask.get_batch_iterator",
    "failed saves": "fairseq.checkpoint_utils.torch_persistent_save",
    "save-directory lock and debris": "fairseq.checkpoint_utils.load_checkpoint",
    "binarized data": "fairseq.data.indexed_dataset.MMapIndexedDataset._do_init",
    "shutdown": "getattr(getattr(sys.modules.get('powernorm_fairseq.patches.shutdown'), 'install', None), "
                "'installed', False)",
    "bf16 without a TPU": "fairseq.dataclass.utils.convert_namespace_to_omegaconf",
    "NaN detector": "fairseq.nan_detector.NanDetector.add_hooks",
    "diverged updates": "fairseq.trainer.Trainer.train_step",
    "norm regularizers": "fairseq.trainer.Trainer.train_step",
    "weights-only checkpoints": "argparse.Namespace in torch.serialization.get_safe_globals()",
    "weights-only loads in fairseq": "torch.load",
    # it acts on fairseq_cli.interactive alone (imported only by fairseq-interactive): installed, it has
    "over-long interactive lines": "getattr(getattr(sys.modules.get('powernorm_fairseq.patches.errors'), "
                                   "'skip_overlong_interactive_lines', None), 'installed', False)",
}


def test_fairseq_is_changed_only_where_the_models_ask():
    """Under --user-dir the import registers the models and installs AT_IMPORT
    (fairseq also calls every model's add_args then); the rest comes with a
    plugin architecture, so a stock model's run is fairseq's own. AT_START is
    there before the import: the .pth installed it when the process started."""
    names = [p.name for p in patches.AT_IMPORT + patches.WITH_THE_MODELS if p.name != "NumPy 2"]
    assert sorted(names) == sorted(PATCHED)  # every patch but NumPy 2's (a no-op on NumPy 1) is checked
    exprs = "[" + ", ".join(PATCHED[n] for n in names) + "]"
    out = python(f"""
import argparse, sys, torch
import fairseq, fairseq.utils, fairseq.checkpoint_utils, fairseq.file_io, fairseq.file_utils, fairseq.tasks
import fairseq.data.indexed_dataset
import fairseq.dataclass.utils, fairseq.nan_detector, fairseq.trainer
from fairseq.models import ARCH_MODEL_REGISTRY
before = {exprs}
fairseq.utils.import_user_module(argparse.Namespace(user_dir={str(USER_DIR)!r}))  # as --user-dir does
registered = "powernorm_transformer_iwslt_de_en" in ARCH_MODEL_REGISTRY
at_import = {exprs}
from fairseq.models import ARCH_CONFIG_REGISTRY
ARCH_CONFIG_REGISTRY["powernorm_transformer_iwslt_de_en"](argparse.Namespace())
with_models = {exprs}
print(registered)
for name, b, i, m in zip({names!r}, before, at_import, with_models):
    print(name, b is not i and b != i, b is not m and b != m)
""")
    lines = out.strip().splitlines()
    assert lines[0] == "True"
    changed = {line.rsplit(" ", 2)[0]: line.rsplit(" ", 2)[1:] for line in lines[1:]}
    at_import = {p.name for p in patches.AT_IMPORT}
    at_start = {p.name for p in patches.AT_START}
    for name in names:
        if name in at_start:  # replaced before the plugin's import: by the guard the .pth loaded at start-up
            assert changed[name] == ["False", "False"], name
            continue
        assert changed[name] == ["True" if name in at_import else "False", "True"], name
    guarded = python("import fairseq.file_utils as f; print(f.load_archive_file.__module__)")
    assert guarded.strip() == "powernorm_fairseq.patches.archives"


@pytest.mark.fast
def test_every_patch_names_a_test_that_exists():
    for patch in patches.AT_IMPORT + patches.WITH_THE_MODELS:
        file, function = patch.test.split("::")
        assert re.search(rf"^def {function}\(", (ROOT / "tests" / file).read_text(), re.M), patch


def test_a_stock_model_trains_as_without_the_plugin(toy_data, tmp_path):
    """fairseq's own transformer with and without --user-dir: the same losses,
    and none of the plugin's training guards (no save-directory lock)."""
    def stock(save_dir, user_dir):
        args = [str(a) for a in train_args(toy_data, save_dir, max_update=6)]
        args[args.index("--arch") + 1] = "transformer"
        if not user_dir:
            i = args.index("--user-dir")
            del args[i:i + 2]
        assert ("--user-dir" in args) == user_dir
        proc = cli("fairseq-train", *args)
        return losses(proc.stdout + proc.stderr)

    plain, plugin = stock(tmp_path / "plain", False), stock(tmp_path / "plugin", True)
    assert len(plain) == 6 and plain == plugin
    assert not (tmp_path / "plugin" / ".powernorm-train.lock").exists()
    plugin_model = cli("fairseq-train", *train_args(toy_data, tmp_path / "model", max_update=1))
    assert plugin_model.returncode == 0 and (tmp_path / "model" / ".powernorm-train.lock").exists()


@pytest.mark.fast
def test_every_patch_installs_once():
    """One mechanism marks every installer done: a second call changes nothing
    (fairseq calls the architectures and build_model many times)."""
    from fairseq.file_io import PathManager

    from powernorm_fairseq.patches.base import installs_once

    assert all(getattr(p.install, "installed", None) is not None for p in patches.AT_IMPORT + patches.WITH_THE_MODELS
               if p.name != "weights-only checkpoints")  # add_safe_globals is idempotent itself
    patches.checkpoints.atomic_checkpoint_copies()
    copy = PathManager.copy
    patches.checkpoints.atomic_checkpoint_copies()
    assert PathManager.copy is copy and patches.checkpoints.atomic_checkpoint_copies.installed
    calls = []
    counted = installs_once(lambda: calls.append(1))
    counted(), counted()
    assert calls == [1] and counted.installed


def test_the_usage_error_patch_reaches_fairseqs_parsers_only(capsys):
    """With the plugin's patches in, a parser of the user's own (or pytest's,
    or hydra's) keeps argparse's usage line; fairseq's parsers give one line."""
    import argparse

    from fairseq import options

    from powernorm_fairseq import patches

    patches.for_the_models()
    own = argparse.ArgumentParser(prog="mine")
    own.add_argument("--n", type=int)
    with pytest.raises(SystemExit):
        own.parse_args(["--n", "x"])
    assert "usage: mine" in capsys.readouterr().err
    fairseqs = options.get_training_parser()
    fairseqs.prog = "fairseq-train"  # as the console script names it (sys.argv[0])
    with pytest.raises(SystemExit):
        fairseqs.parse_args(["--max-update", "x"])
    err = capsys.readouterr().err
    assert "usage:" not in err and err.strip().count("\n") == 0 and "error: argument --max-update" in err


def test_rbn_penalty_weighs_the_same_at_any_world_size_and_update_frequency(toy_data, tmp_path):
    """fairseq's trainer adds each forward's rbn penalty to whatever the criterion returns, weighted
    1 / (forwards in the update x workers): an update of two forwards has the gradient of the summed
    losses plus the mean of the two penalties, over the tokens. The loss it logs is the criterion's."""
    import copy

    import torch
    from fairseq import tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.options import get_training_parser, parse_args_and_arch
    from fairseq.trainer import Trainer

    from powernorm_fairseq.norms.rbn import regularization

    argv = train_args(toy_data, tmp_path, "--norm-type", "rbn", "--decoder-norm-type", "rbn", "--rbn-penalty-mean",
                      "3", "--rbn-penalty-var", "0.5", "--dropout", "0", "--cpu")
    cfg = convert_namespace_to_omegaconf(parse_args_and_arch(get_training_parser(), list(map(str, argv))))
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(0)
    model, criterion = task.build_model(cfg.model), task.build_criterion(cfg.criterion)
    task.load_dataset("valid")
    data = task.dataset("valid")
    batches = [data.collater([data[i] for i in range(k, k + 6)]) for k in (0, 6)]
    before = copy.deepcopy(model)

    def gradients(weight):
        """The reference: one backward of both forwards' criterion losses and weight x their penalties."""
        ref = copy.deepcopy(before).train()
        total, size = 0, 0
        for sample in batches:
            loss, sample_size, _ = criterion(ref, sample)
            total, size = total + loss + weight * regularization(ref), size + sample_size
        total.backward()
        return [p.grad / size for p in ref.parameters()]

    trainer = Trainer(cfg, task, model, criterion)
    trainer.train_step(batches)
    got = [p.grad for p in model.parameters()]
    close = [all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(got, gradients(w))) for w in (0.5, 1, 0)]
    assert close == [True, False, False]  # the mean of the penalties: not their sum, nor none
