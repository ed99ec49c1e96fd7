"""End to end through the real fairseq commands with --user-dir powernorm_fairseq."""

import math
import re
import shutil
import subprocess
from statistics import mean

import pytest
import torch

from support import USER_DIR, Command, cli, losses, train_args

pytestmark = pytest.mark.slow

@pytest.mark.parametrize("norm", ["ln", "bn", "pn", "pn-v", "scalenorm"])
def test_train_then_generate(toy_data, trained, norm):
    save = trained(norm)
    curve = losses((save / "train.log").read_text())
    assert len(curve) == 40
    assert mean(curve[-5:]) < mean(curve[:5]) - 1.0, curve  # bits per token
    state = torch.load(save / "checkpoint_last.pt", weights_only=True)
    assert state["cfg"]["model"].norm_type == norm
    gen = cli("fairseq-generate", toy_data, "--user-dir", USER_DIR, "--path", save / "checkpoint_last.pt",
              "--beam", "5", "--remove-bpe", "--batch-size", "8", "--required-batch-size-multiple", "1")
    hyps = [line for line in gen.stdout.splitlines() if line.startswith("H-")]
    assert len(hyps) == 27  # every test sentence, none dropped with a partial last batch
    assert "BLEU4" in gen.stdout


def test_resume_restores_every_norm_buffer(toy_data, tmp_path):
    """What the plugin owns in a resume: running statistics, nu and the warmup
    counter come back exactly as saved."""
    from fairseq import checkpoint_utils

    import powernorm_fairseq.models  # noqa: F401  (registers the models in this process, as --user-dir does)

    cli("fairseq-train", *train_args(toy_data, tmp_path, "--norm-type", "pn", "--decoder-norm-type", "bn",
                                     max_update=7))
    saved = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)["model"]
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task(
        [str(tmp_path / "checkpoint_last.pt")], arg_overrides={"data": str(toy_data)})
    loaded = dict(models[0].named_buffers())
    keys = [k for k in saved if ".running_" in k or k.endswith("num_steps")]
    assert len(keys) > 20 and all(torch.equal(loaded[k], saved[k]) for k in keys)
    assert int(saved["encoder.layer_norm.num_steps"]) == 7 and saved["encoder.layer_norm.running_nu"].abs().sum() > 0


def test_resuming_with_other_norms_fails_in_one_line(toy_data, trained, tmp_path):
    shutil.copy(trained("pn") / "checkpoint_last.pt", tmp_path)
    proc = cli("fairseq-train", *train_args(toy_data, tmp_path, "--norm-type", "ln", max_update=4), check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"fairseq-train: error: {tmp_path}/checkpoint_last.pt: trained as another model "
                           "(--norm-type: the checkpoint has pn, this asks ln;")
    assert last.endswith("pass the checkpoint's settings, or --allow-setting-changes to fine-tune it into this "
                         "model on purpose")


def test_interactive_translates(toy_data, trained):
    proc = cli("fairseq-interactive", toy_data, "--user-dir", USER_DIR, "--path",
               trained("pn") / "checkpoint_last.pt", "--source-lang", "de", "--target-lang", "en",
               input="haus katze\n", timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"^H-0\t", proc.stdout, re.M)


def test_fairseq_is_quiet_as_the_readme_says(toy_data, trained):
    """The README's two ways to quiet fairseq: its commands' results alone on stdout (its log and
    warnings on stderr), and in Python the hub's translation alone, with its lines before and after the
    imports."""
    import sys
    from pathlib import Path

    run = trained("pn")
    interactive = subprocess.run([str(Path(sys.executable).parent / "fairseq-interactive"), str(toy_data),
                                  "--user-dir", USER_DIR, "--path", str(run / "checkpoint_last.pt"),
                                  "--source-lang", "de", "--target-lang", "en", "--cpu"],
                                 input="haus katze\n", capture_output=True, text=True, timeout=300)
    assert interactive.returncode == 0 and "fairseq_cli.interactive" in interactive.stderr, interactive.stderr[-2000:]
    results = interactive.stdout.strip().splitlines()
    assert results and all(re.match(r"[SWHDP]-0\t", line) for line in results), results
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert "`2> fairseq.log` leaves the results alone" in readme
    snippet = re.search(r"```python\n(import logging, warnings\n.*?logging\.getLogger\(\)\.setLevel\(logging\.WARNING\)"
                        r"[^\n]*\n)", readme, re.S)[1]
    hub = subprocess.run([sys.executable, "-c", snippet + f"hub = TransformerModel.from_pretrained({str(run)!r}, "
                          f"checkpoint_file='checkpoint_last.pt', data_name_or_path={str(toy_data)!r}, "
                          f"user_dir={str(USER_DIR)!r})\nprint(hub.translate('haus katze'))\n"],
                         capture_output=True, text=True, timeout=300)
    assert hub.returncode == 0 and hub.stderr == "" and len(hub.stdout.splitlines()) == 1, hub.stderr[-2000:]


@pytest.mark.parametrize("flags, message", [
    (["--pn-alpha-fwd", "1.5"], "argument --pn-alpha-fwd: --pn-alpha-fwd must be in (0, 1), got 1.5"),
    (["--norm-type", "layer"], "argument --norm-type: invalid choice: 'layer'"),
    (["--norm-placement", "middle"], "argument --norm-placement: invalid choice: 'middle'"),
    (["--pn-backward", "approx"], "argument --pn-backward: invalid choice: 'approx'"),
    (["--norm-sync", "all"], "argument --norm-sync: invalid choice: 'all' (choose from 'none', 'batch', 'running')"),
    (["--norm-momentum", "0"], "argument --norm-momentum: --norm-momentum must be in (0, 1), got 0"),
    (["--pn-warmup-updates", "-1"], "argument --pn-warmup-updates: must be >= 0, got -1"),
    (["--pn-eps", "0"], "argument --pn-eps: must be > 0, got 0"),
    (["--norm-diagnostics-interval", "0"],
     "argument --norm-diagnostics-interval: --norm-diagnostics-interval must be >= 1, got 0"),
    (["--no-share-all-embeddings-please"], "unrecognized arguments"),
    (["--norm-typ", "pn"], "unrecognized arguments: --norm-typ pn (--norm-typ: did you mean --norm-type?)"),
    (["--arch", "transformer_iwslt_de_en", "--norm-type", "pn"],
     "unrecognized arguments: --norm-type pn (--norm-type: a flag of the plugin's architectures, which --arch "
     "must name: powernorm_classifier, powernorm_transformer, powernorm_transformer_iwslt_de_en"),
])
def test_bad_flag_values_fail_in_one_line(toy_data, tmp_path, flags, message):
    proc = cli("fairseq-train", *train_args(toy_data, tmp_path, *flags), check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # one line, no usage block
    assert message in proc.stderr.strip()
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("flags, message", [
    (["--norm-placement", "post", "--decoder-normalize-before"],
     "--decoder-normalize-before contradicts --norm-placement post"),
    (["--layernorm-embedding"], "--layernorm-embedding adds a LayerNorm"),
    (["--pn-backward", "reference", "--norm-sync", "batch"], "use --norm-sync none (got --norm-sync batch)"),
    (["--encoder-norm-ff", "bn-original", "--norm-sync", "running"],
     "bn-original reproduces the released code, which never synchronised statistics across workers: "
     "use --norm-sync none (got --norm-sync running)"),
    pytest.param(["--fp16"], "--fp16 without a GPU: fairseq's flattened fp16 master weights need CUDA; train on "
                 "a GPU, or add --cpu --fp16-no-flatten-grads",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU takes --fp16")),
    pytest.param(["--memory-efficient-fp16"], "--memory-efficient-fp16 without a GPU: fairseq's flattened fp16",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU takes --fp16")),
    (["--fp16", "--cpu"], "need CUDA; train on a GPU, or add --fp16-no-flatten-grads"),  # --cpu is given already
    (["--rezero-gates", "layer"], "--rezero-gates layer: ReZero's gates, and --norm-placement pre has none"),
    (["--qk-norm-scope", "projection"], "--qk-norm-scope projection: the scope of --qk-norm, which is not given"),
])
def test_bad_flag_combinations_fail_in_one_line(toy_data, tmp_path, flags, message):
    proc = cli("fairseq-train", *train_args(toy_data, tmp_path, *flags), check=False)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fairseq-train: error: ") and message in last
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())


def test_fixnorm_without_tied_embeddings_fails_in_one_line(toy_data, tmp_path):
    args = [a for a in train_args(toy_data, tmp_path, "--fixnorm") if a != "--share-all-embeddings"]
    proc = cli("fairseq-train", *args, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "--fixnorm needs tied embeddings" in proc.stderr.strip().splitlines()[-1]


def test_fixnorm_scalenorm_post_norm_row_trains(toy_data, tmp_path):
    """The "Transformers without Tears" row: ScaleNorm + FixNorm + SmallInit."""
    proc = cli("fairseq-train", *train_args(
        toy_data, tmp_path, "--norm-type", "scalenorm", "--decoder-norm-type", "scalenorm",
        "--fixnorm", "--small-init", "--norm-placement", "post"))
    curve = losses(proc.stdout + proc.stderr)
    assert mean(curve[-5:]) < mean(curve[:5]) - 1.0, curve


@pytest.mark.parametrize("norm", ["ln", "pn", "bn"])
def test_resume_is_bit_identical_to_an_uninterrupted_run(toy_data, tmp_path, norm):
    """Stopped at update 13 (in epoch 2) and resumed: the same losses, running
    statistics, nu, warmup counter and weights as one run to update 26. (Without
    powernorm_fairseq.patches.checkpoints.resume_with_the_same_batches this fails for
    stock LN too: fairseq rebuilds the batches with another seed on resume.)"""
    flags = ["--norm-type", norm, "--pn-warmup-updates", "6", "--dropout", "0.1"]
    straight = cli("fairseq-train", *train_args(toy_data, tmp_path / "a", *flags, max_update=26))
    cli("fairseq-train", *train_args(toy_data, tmp_path / "b", *flags, max_update=13))
    resumed = cli("fairseq-train", *train_args(toy_data, tmp_path / "b", *flags, max_update=26))
    log = resumed.stdout + resumed.stderr
    assert "Loaded checkpoint" in log and "@ 13 updates" in log  # from the last checkpoint
    a, b = losses(straight.stdout + straight.stderr), losses(log)
    assert len(a) == 26 and len(b) == 13 and a[13:] == b
    state = torch.load(tmp_path / "b" / "checkpoint_last.pt", weights_only=True)
    assert state["extra_state"]["train_iterator"]["epoch"] >= 1
    if norm == "pn":
        assert int(state["model"]["encoder.layer_norm.num_steps"]) == 26  # one PN step per update
    sa = torch.load(tmp_path / "a" / "checkpoint_last.pt", weights_only=True)["model"]
    sb = state["model"]
    assert sa.keys() == sb.keys()
    different = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not different, different


@pytest.mark.parametrize("flags, message", [
    (["--source-lang", "de", "--target-lang", "en"], "fairseq-train: error: no such file: {empty}/dict.de.txt"),
    ([], "fairseq-train: error: Could not infer language pair, please provide it explicitly"),
    (["--valid-subset", "test"], "fairseq-train: error: {empty}: no binarized 'test' split (fairseq-preprocess "
                                 "--testpref makes it; --train-subset/--valid-subset pick another)"),
])
def test_data_directory_without_dictionary(toy_data, tmp_path, flags, message):
    empty = tmp_path / "data"
    empty.mkdir()
    if "--valid-subset" in flags:  # dictionaries and the train split only
        for path in toy_data.glob("*"):
            if path.name.startswith(("dict.", "train.")):
                shutil.copy(path, empty)
    args = train_args(empty, tmp_path / "ckpt", *flags)
    proc = cli("fairseq-train", *args, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == message.format(empty=empty)
    assert not list(tmp_path.glob("ckpt/*"))  # fairseq may create the empty --save-dir, nothing in it


def test_sentences_longer_than_max_positions(toy_data, tmp_path):
    proc = cli("fairseq-train", *train_args(toy_data, tmp_path / "ckpt", "--max-source-positions", "8"),
               check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fairseq-train: error: Size of sample") and "since max_positions=(8, " in last
    assert last.endswith("skip this example with --skip-invalid-size-inputs-valid-test")
    ok = cli("fairseq-train", *train_args(toy_data, tmp_path / "ok", "--max-source-positions", "8",
                                          "--skip-invalid-size-inputs-valid-test", max_update=3))
    assert "num_updates\": \"3\"" in ok.stdout + ok.stderr


def test_ctrl_c_leaves_a_resumable_checkpoint(toy_data, tmp_path):
    import signal

    args = train_args(toy_data, tmp_path, "--norm-type", "pn", "--save-interval-updates", "3", max_update=100000)
    # the command takes SIGINT as an interpreter started from a terminal does
    # (a suite started in the background inherits SIGINT ignored)
    proc = Command("fairseq-train", args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen = []
    try:
        for line in proc.stdout:  # interrupt right after the second checkpoint save starts
            seen.append(line)
            if sum("Saving checkpoint to" in l for l in seen) >= 2:
                proc.send_signal(signal.SIGINT)
                break
        rest = proc.stdout.read()
        proc.wait(timeout=120)
    finally:
        proc.kill()  # a run that ignored the interrupt must not outlive the test
        proc.stdout.close()
    output = "".join(seen) + rest
    assert proc.returncode != 0 and "Traceback" not in output
    assert output.strip().splitlines()[-1].startswith("fairseq-train: interrupted;")
    state = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)  # intact
    done = state["optimizer_history"][-1]["num_updates"]
    assert done >= 3
    resumed = cli("fairseq-train", *train_args(toy_data, tmp_path, "--norm-type", "pn", "--save-interval-updates",
                                               "3", max_update=done + 2))
    assert f"@ {done} updates" in resumed.stdout + resumed.stderr
    assert f'"num_updates": "{done + 2}"' in resumed.stdout + resumed.stderr


def test_checkpoint_without_user_dir(toy_data, trained, tmp_path):
    """Stock fairseq cannot load a checkpoint of this model: torch's weights-only
    unpickler stops at the Namespace of every fairseq checkpoint, before any
    model code; documented in docs/robustness.md."""
    checkpoint = trained("pn") / "checkpoint_last.pt"
    proc = cli("fairseq-generate", toy_data, "--path", checkpoint, "--batch-size", "8", check=False, cwd=tmp_path)
    assert proc.returncode != 0 and "argparse.Namespace" in proc.stderr
    ok = cli("fairseq-generate", toy_data, "--user-dir", USER_DIR, "--path", checkpoint,
             "--batch-size", "8", "--required-batch-size-multiple", "1")
    assert "BLEU4" in ok.stdout


@pytest.mark.parametrize("norms, flags", [
    ({"norm_type": "rmsnorm", "encoder_norm_ff": "layernorm-simple", "decoder_norm_type": "detachnorm",
      "decoder_norm_self": "adanorm", "decoder_norm_cross": "groupnorm", "decoder_norm_ff": "none"},
     ["--detachnorm-detach", "mean", "--adanorm-scale", "2", "--norm-groups", "2"]),
    ({"norm_type": "bn-original", "encoder_norm_ff": "rbn", "decoder_norm_type": "rmsnorm"},
     ["--rbn-penalty-mean", "0.5"]),
    ({"norm_type": "derf", "decoder_norm_type": "dyt", "qk_norm": "derf"}, ["--derf-alpha-init", "0.7"]),
], ids=["six-kinds", "bn-original-rbn", "derf-dyt"])
def test_more_norm_kinds_train_and_generate(toy_data, tmp_path, norms, flags):
    """Every other kind, in as few runs as their sublayers allow."""
    given = [a for key, kind in norms.items() for a in ("--" + key.replace("_", "-"), kind)]
    proc = cli("fairseq-train", *train_args(toy_data, tmp_path, *given, *flags, max_update=12))
    curve = losses(proc.stdout + proc.stderr)
    assert len(curve) == 12 and all(math.isfinite(v) for v in curve) and curve[-1] < curve[0]
    assert (proc.stdout.count('"rbn_penalty": ') == 12) == ("rbn" in norms.values())  # its regulariser, logged
    gen = cli("fairseq-generate", toy_data, "--user-dir", USER_DIR, "--path", tmp_path / "checkpoint_last.pt",
              "--beam", "2", "--batch-size", "8", "--required-batch-size-multiple", "1")
    assert len([l for l in gen.stdout.splitlines() if l.startswith("H-")]) == 27
    model = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)["cfg"]["model"]
    assert {key: getattr(model, key) for key in norms} == norms


def test_norm_groups_must_divide_the_width(toy_data, tmp_path):
    proc = cli("fairseq-train", *train_args(toy_data, tmp_path, "--norm-type", "groupnorm", "--norm-groups", "5"),
               check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == \
        "fairseq-train: error: --norm-groups 5 does not divide --encoder-embed-dim 32"


def test_original_code_spellings_run_unchanged(toy_data, tmp_path):
    """A command of the authors' repository: per-sublayer norms as layer/batch/power."""
    proc = cli("fairseq-train", *train_args(toy_data, tmp_path, "--encoder-norm-self", "power",
                                            "--encoder-norm-ff", "power", "--decoder-norm-self", "layer",
                                            "--decoder-norm-ff", "layer", max_update=8))
    assert len(losses(proc.stdout + proc.stderr)) == 8
    model = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)["cfg"]["model"]
    assert (model.encoder_norm_self, model.decoder_norm_ff) == ("pn", "ln")
    bad = cli("fairseq-train", *train_args(toy_data, tmp_path / "bad", "--encoder-norm-ff", "layernorm"),
              check=False)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert ("argument --encoder-norm-ff: invalid choice: 'layernorm' (choose from ln, bn"
            in bad.stderr.strip().splitlines()[-1])


def _misspelt(option):
    """``option`` with two inner letters swapped (``--table`` -> ``--tbale``)."""
    i = len(option) // 2
    return option[:i] + option[i + 1] + option[i] + option[i + 2:]


def test_every_command_names_the_option_nearest_a_misspelt_one(capsys):
    """Each script (scripts/, data-prep/) and each console command, given one of its own options
    misspelt: one line and a failing exit status, naming the option it meant ("did you mean --table?"),
    without the usage block. A script's options are read from its usage text; a console command's (and
    a script's that runs one) from its --help, in this process."""
    import importlib
    import tomllib

    from support import ROOT

    scripts, mains = [], []
    for path in sorted([*ROOT.glob("scripts/*.sh"), *ROOT.glob("data-prep/*.sh")]):
        text = path.read_text()
        runs = re.search(r"^exec python -m (\S+)", text, re.M)
        if runs:
            mains.append(importlib.import_module(runs.group(1)).main)
        elif path.name not in ("lib.sh", "test.sh"):  # test.sh hands what it does not know to pytest
            scripts.append((path, text.split("USAGE", 2)[1]))
    for target in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"].values():
        module, function = target.split(":")
        mains.append(getattr(importlib.import_module(module), function))
    assert len(scripts) >= 11 and len(mains) >= 6

    def first_option(usage):
        options = [o for o in re.findall(r"(?<![\w-])--[a-z][a-z-]{4,}", usage) if o != "--help"]
        assert options, usage
        return options[0]

    meant = [first_option(usage) for _, usage in scripts]
    runs = [subprocess.Popen(["bash", str(path), _misspelt(option), "x"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=ROOT) for (path, _), option in zip(scripts, meant)]
    said = []
    for (path, _), option, proc in zip(scripts, meant, runs):
        err = proc.communicate(timeout=120)[1]
        said.append((path.name, option, proc.returncode, err))
    for main in mains:
        with pytest.raises(SystemExit):
            main(["--help"])
        option = first_option(capsys.readouterr().out)
        with pytest.raises(SystemExit) as end:
            main([_misspelt(option), "x"])
        said.append((main.__module__, option, end.value.code, capsys.readouterr().err))
    for name, option, code, err in said:
        lines = err.strip().splitlines()
        assert code != 0 and len(lines) == 1 and f"did you mean {option}?" in lines[0], (name, err)
