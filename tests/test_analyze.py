"""--norm-diagnostics through fairseq-train, and powernorm-analyze on the runs."""

import argparse
import csv
import math

import pytest
import torch

from support import Command, cli, once, train_args
from powernorm_fairseq.cli.landscape import Probe, training_batches
from powernorm_fairseq.cli.analyze import (
    normalized_singular_values,
    read_diagnostics,
    spectrum,
)

pytestmark = pytest.mark.slow

RUNS = {
    "ln": ["--norm-type", "ln", "--norm-diagnostics"],
    "bn": ["--norm-type", "bn", "--norm-diagnostics"],
    "pn-v": ["--norm-type", "pn-v", "--norm-diagnostics", "--norm-diagnostics-interval", "2"],
    "pn": ["--norm-type", "pn", "--norm-diagnostics"],
    "pn-off": ["--norm-type", "pn"],
    "bn-simple": ["--norm-type", "bn", "--norm-diagnostics", "--log-format", "simple"],
}
LAYERS = {"enc0.attn", "enc0.ffn", "enc1.attn", "enc1.ffn", "enc.final"}


@pytest.fixture(scope="session")
def runs(toy_data, tmp_path_factory):
    """Short runs (16 updates, logged every 4) with a JSON --log-file each,
    trained once for the session."""
    return once(tmp_path_factory, "runs", lambda root: _train_runs(toy_data, root))


def _train_runs(toy_data, root):
    running = []
    for name, flags in RUNS.items():  # side by side: each trains on one core
        (root / name).mkdir()
        args = train_args(toy_data, root / name, *flags, max_update=16)
        args[args.index("--log-interval") + 1] = "4"
        if name.endswith("simple"):  # the console saved, as scripts/train.sh does
            with open(root / name / "train.log", "w") as log:
                running.append(Command("fairseq-train", args, stdout=log, stderr=log))
        else:
            running.append(Command("fairseq-train", [*args, "--log-file", root / name / "train.log"]))
    for command in running:
        assert command.wait(600) == 0, command.args


def records(path):
    rows = {}
    for kind, layer, metric, update, value in read_diagnostics(path):
        rows.setdefault((kind, metric), {}).setdefault(layer, []).append((update, value))
    return rows


@pytest.mark.parametrize("name, kind, metrics, updates", [
    ("bn", "bn", {"dist_mu", "dist_var", "grad_mu", "grad_var", "tid_mu", "tid_sigma"}, [4, 8, 12, 16]),
    ("pn-v", "pn-v", {"dist_psi2", "grad_psi2", "tid_psi"}, [4, 8, 12, 16]),
    ("pn", "pn", {"dist_psi2", "grad_psi2", "tid_psi"}, [4, 8, 12, 16]),
])
def test_logged_statistics_are_finite_and_nonzero(runs, name, kind, metrics, updates):
    rows = records(runs / name / "train.log")
    assert {k for k, _ in rows} == {kind} and {m for _, m in rows} == metrics
    for per_layer in rows.values():
        assert set(per_layer) == LAYERS  # the decoder's norms are LN
        for points in per_layer.values():
            assert [u for u, _ in points] == updates
            assert all(math.isfinite(v) and v > 0 for _, v in points)


def test_simple_and_json_logs_read_the_same(runs):
    simple = sorted(read_diagnostics(runs / "bn-simple" / "train.log"))
    assert len(simple) == 6 * 5 * 4 and simple == sorted(read_diagnostics(runs / "bn" / "train.log"))


def test_layernorm_logs_no_statistics(runs):
    assert read_diagnostics(runs / "ln" / "train.log") == []
    log = (runs / "ln" / "train.log").read_text()
    assert '"loss"' in log and "diag/" not in log


def test_diagnostics_leave_training_bit_identical(runs):
    on = torch.load(runs / "pn" / "checkpoint_last.pt", weights_only=True)
    off = torch.load(runs / "pn-off" / "checkpoint_last.pt", weights_only=True)
    assert on["model"].keys() == off["model"].keys()
    assert all(torch.equal(on["model"][k], off["model"][k]) for k in on["model"])
    assert on["last_optimizer_state"]["state"].keys() == off["last_optimizer_state"]["state"].keys()
    states = zip(on["last_optimizer_state"]["state"].values(), off["last_optimizer_state"]["state"].values())
    assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for s, t in states
               for a, b in zip(s.values(), t.values()))


def read_csv(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], rows[1:]


def test_analyze_writes_every_plot_and_table(runs, toy_data, tmp_path):
    from matplotlib import image

    ablation = tmp_path / "figure5.csv"
    ablation.write_text("norm,stat_batch_tokens,update_freq,bleu,sacrebleu,checkpoints_averaged\n"
                        "bn,512,8,30.1,29.5,5\nbn,4096,1,34.4,34.0,5\npn,512,8,35.2,34.9,5\npn,4096,1,35.9,35.5,5\n")
    ckpts = [runs / n / "checkpoint_last.pt" for n in ("ln", "bn", "pn")]
    out = tmp_path / "analysis"
    proc = cli("powernorm-analyze", "--out", out, "--logs", runs, "--checkpoints", *ckpts,
               "--ablation", ablation, "--landscape", "--data", toy_data, "--batches", "2",
               "--max-tokens", "300", "--steps", "3")
    assert "ln/train.log: no diag/ metrics" in proc.stderr
    for png in ("statistics", "gradients", "discrepancy", "spectrum", "batch_size", "landscape"):
        pixels = image.imread(out / f"{png}.png")
        assert pixels.ndim == 3 and pixels.shape[0] > 300 and pixels.shape[1] > 500
        assert pixels.std() > 0.05  # not a blank canvas

    header, rows = read_csv(out / "statistics.csv")
    assert header == ["run", "norm_type", "layer", "metric", "update", "value"]
    assert {(r[0], r[1]) for r in rows} == {("bn", "bn"), ("bn-simple", "bn"), ("pn-v", "pn-v"), ("pn", "pn")}

    header, rows = read_csv(out / "spectrum.csv")
    assert header == ["checkpoint", "norm_type", "update", "index", "singular_value", "normalized"]
    assert len(rows) == 3 * 32 and {r[1] for r in rows} == {"ln", "bn", "pn"} and {r[2] for r in rows} == {"16"}

    header, rows = read_csv(out / "batch_size.csv")
    assert header == ["source", "norm_type", "stat_batch_tokens", "bleu", "sacrebleu"]
    assert [r[1:4] for r in rows][-1] == ["pn", "4096", "35.9"]

    header, rows = read_csv(out / "landscape.csv")
    assert header == ["checkpoint", "norm_type", "update", "batch", "step_size", "loss", "loss_change",
                      "grad_change"]
    assert len(rows) == 3 * 2 * 3
    assert sorted({float(r[4]) for r in rows}) == pytest.approx([0.003 * k / 4 for k in (1, 2, 3)])
    header, summary = read_csv(out / "landscape_summary.csv")
    assert header == ["checkpoint", "norm_type", "update", "lr", "batches", "lipschitz", "smoothness",
                      "grad_norm", "initial_grad_norm"]
    for row in summary:
        mine = [r for r in rows if r[0] == row[0]]
        per_batch = [max(float(r[6]) for r in mine if r[3] == b) for b in ("0", "1")]
        assert float(row[5]) == pytest.approx(sum(per_batch) / 2)  # mean over batches of the max
        assert all(math.isfinite(float(v)) and float(v) > 0 for v in row[5:])


def test_probe_gradient_predicts_the_loss_change(runs, toy_data):
    """For a small step along the gradient, L(W) - L(W - a g) = a ||g||^2 to first order."""
    from fairseq import checkpoint_utils

    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(runs / "ln" / "checkpoint_last.pt")], arg_overrides={"data": str(toy_data)})
    model = models[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    probe = Probe(model, task.build_criterion(cfg.criterion))
    sample = training_batches(task, model, "valid", 1, 300, 1)[0]
    loss0, grad = probe(sample)
    a = 1e-4
    loss1, _ = probe(sample, grad, a)
    assert loss0 - loss1 == pytest.approx(a * grad.dot(grad).item(), rel=0.05)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # restored


@pytest.mark.fast
def test_singular_values_of_a_known_matrix(tmp_path):
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(40, 6, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))
    s = torch.tensor([8.0, 4.0, 2.0, 1.0, 0.5, 0.0], dtype=torch.float64)
    matrix = u @ torch.diag(s) @ v.t()
    values, normalized = normalized_singular_values(matrix)
    assert torch.allclose(values, s, atol=1e-12)
    assert torch.allclose(normalized, s / 8, atol=1e-12)

    path = tmp_path / "checkpoint3.pt"
    torch.save({"model": {"encoder.embed_tokens.weight": matrix.float()},
                "cfg": {"model": argparse.Namespace(norm_type="pn")},
                "optimizer_history": [{"num_updates": 7}]}, path)
    rows = spectrum([path], "encoder.embed_tokens.weight")
    assert [r[1:4] for r in rows] == [("pn", 7, i) for i in range(1, 7)]
    assert [r[5] for r in rows] == pytest.approx([1.0, 0.5, 0.25, 0.125, 0.0625, 0.0], abs=1e-6)


@pytest.mark.parametrize("make_args, message", [
    (lambda d: ["--logs", d / "missing"], "no such log file or directory"),
    (lambda d: ["--checkpoints", d / "missing.pt"], "no such checkpoint"),
    (lambda d: ["--checkpoints", d / "ckpt.pt", "--landscape"], "--landscape needs --checkpoints and --data"),
    (lambda d: ["--checkpoints", d / "ckpt.pt", "--landscape", "--data", d], "has no fairseq dictionary"),
    (lambda d: ["--ablation", d / "bad.csv"], "is not a figure5.csv"),
    (lambda d: ["--logs", d / "plain.log"], "no log has diag/ metrics"),
    (lambda d: [], "nothing to analyze"),
    (lambda d: ["--checkpoints", d / "bad.csv"], "not a readable checkpoint"),
])
def test_bad_input_fails_in_one_line_and_writes_nothing(tmp_path, make_args, message):
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    (tmp_path / "plain.log").write_text("epoch 1 | loss 3.2\n")
    (tmp_path / "ckpt.pt").write_bytes(b"")
    out = tmp_path / "out"
    proc = cli("powernorm-analyze", "--out", out, *make_args(tmp_path), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert message in proc.stderr.strip().splitlines()[-1]
    assert not out.exists()
