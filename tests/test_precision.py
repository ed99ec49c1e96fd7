"""Half precision: float32 statistics and buffers, no overflow, fairseq's fp16 loss-scaler path."""

import math
import re

import pytest
import torch

from support import cli, train_args
from powernorm_fairseq.norms import build_norm

pytestmark = pytest.mark.fast

T, B, C = 7, 3, 16


@pytest.mark.parametrize("kind", ["bn", "pn-v", "pn", "ln", "scalenorm"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_activations_near_the_float16_maximum(kind, dtype):
    g = torch.Generator().manual_seed(0)
    x32 = (torch.rand(T, B, C, generator=g) * 2 - 1) * 60000  # x^2 ~ 3.6e9 overflows float16
    pad = torch.arange(T)[None, :] >= torch.tensor([T, 5, 2])[:, None]
    half, full = build_norm(kind, C).to(dtype), build_norm(kind, C)
    for name, buf in half.named_buffers():
        if buf.is_floating_point():
            assert buf.dtype == torch.float32, name  # buffers survive the cast
    xh = x32.to(dtype).requires_grad_(True)
    xf = xh.detach().float().requires_grad_(True)
    yh, yf = half(xh, pad), full(xf, pad)
    yh.float().sum().backward()
    yf.sum().backward()
    assert yh.dtype == dtype and torch.isfinite(yh).all() and torch.isfinite(xh.grad).all()
    assert torch.allclose(yh.float(), yf, rtol=2e-2, atol=2e-2)
    for (name, a), (_, b) in zip(half.named_buffers(), full.named_buffers()):
        assert a.dtype == b.dtype and torch.isfinite(a.float()).all()
        assert torch.allclose(a.float(), b.float(), rtol=1e-3), name


def test_non_finite_batches_leave_running_statistics_and_nu_alone():
    for kind in ("bn", "pn-v", "pn"):
        norm = build_norm(kind, C)
        x = torch.randn(T, B, C, requires_grad=True)
        norm(x).sum().backward()  # one good step
        before = {k: v.clone() for k, v in norm.named_buffers() if v.is_floating_point()}
        bad = torch.randn(T, B, C)
        bad[0, 0, 0] = float("inf")  # an overflowed activation
        with torch.no_grad():
            norm(bad)
        for name, value in before.items():
            assert torch.equal(value, getattr(norm, name)), f"{kind}: {name} took a non-finite batch"
    pn = build_norm("pn", C)
    x = torch.randn(T, B, C, requires_grad=True)
    pn(x).sum().backward()
    nu = pn.running_nu.clone()
    x = torch.randn(T, B, C, requires_grad=True)
    pn(x).backward(torch.full((T, B, C), float("inf")))  # an overflowed loss-scaled gradient
    assert torch.equal(pn.running_nu, nu)


@pytest.mark.slow
def test_fp16_training_through_the_cli(toy_data, tmp_path):
    """fairseq's --fp16 on the CPU (fp16 matmuls exist there; flattened fp32
    master weights need CUDA, hence --fp16-no-flatten-grads)."""
    proc = cli("fairseq-train", *train_args(
        toy_data, tmp_path, "--norm-type", "pn", "--cpu", "--fp16", "--fp16-no-flatten-grads",
        "--pn-warmup-updates", "2", max_update=12))
    losses = [float(v) for v in re.findall(r'"loss": "([0-9.]+)"', proc.stdout + proc.stderr)]
    assert len(losses) >= 12 and all(math.isfinite(v) for v in losses)
    state = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)["model"]
    for key, value in state.items():
        if key.endswith(("running_psi2", "running_nu")):
            assert value.dtype == torch.float32 and torch.isfinite(value).all(), key


@pytest.mark.slow
def test_loss_scale_overflow_leaves_nu_alone_and_psi2_finite(toy_data, tmp_path):
    """fairseq's overflow handler calls .cuda() (trainer.py), so its path is
    replayed here: a float16 model, a loss scaled by 2^40 whose gradients
    overflow, the step skipped. nu keeps its value; psi^2 takes the batch's
    finite forward statistic (documented: the weights that produced it are
    still the current ones)."""
    from fairseq import checkpoint_utils

    cli("fairseq-train", *train_args(toy_data, tmp_path, "--norm-type", "pn", "--pn-warmup-updates", "2",
                                     max_update=4))
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(tmp_path / "checkpoint_last.pt")], arg_overrides={"data": str(toy_data)})
    model = models[0].half().train()
    criterion = task.build_criterion(cfg.criterion)
    task.load_dataset("valid")
    sample = next(iter(task.get_batch_iterator(dataset=task.dataset("valid"), max_tokens=600,
                                               seed=1).next_epoch_itr(shuffle=False)))
    nus = {n: b.clone() for n, b in model.named_buffers() if n.endswith("running_nu")}
    psi2 = {n: b.clone() for n, b in model.named_buffers() if n.endswith("running_psi2")}
    loss, _, _ = criterion(model, sample)
    (loss.float() * 2 ** 40).half().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert not all(torch.isfinite(g).all() for g in grads), "the scaled gradient did not overflow"
    for name, buf in model.named_buffers():
        if name in nus:
            assert torch.equal(buf, nus[name]), name
        if name in psi2:
            assert torch.isfinite(buf).all() and not torch.equal(buf, psi2[name]), name


def _curve(log):
    return [float(v) for v in re.findall(r'"loss": "([0-9.naif]+)"', log)]


@pytest.mark.parametrize("norm", ["bn", "pn-v", "pn"])
@pytest.mark.slow
def test_bf16_trains_through_fairseq_without_a_tpu(toy_data, tmp_path, norm):
    """fairseq 0.12 makes --bf16 imply --tpu and then dies without torch_xla;
    with the plugin, --bf16 is fairseq's own bfloat16 path on this device (the
    model in bfloat16, float32 master weights, no loss scaler), and the norms'
    running buffers stay float32. The same run in float32 gives other losses:
    the bfloat16 arithmetic happened."""
    common = ["--norm-type", norm, "--pn-warmup-updates", "4", "--cpu"]
    proc = cli("fairseq-train", *train_args(toy_data, tmp_path / "bf16", *common, "--bf16", max_update=16))
    curve = _curve(proc.stdout + proc.stderr)
    assert len(curve) >= 16 and all(math.isfinite(v) for v in curve), curve
    assert sum(curve[-3:]) < sum(curve[:3]), curve
    state = torch.load(tmp_path / "bf16" / "checkpoint_last.pt", weights_only=True)
    assert state["cfg"]["common"]["bf16"] and not state["cfg"]["common"]["tpu"]
    rows = re.findall(r"\| train_inner \| (\{.*\})", proc.stdout + proc.stderr)
    assert rows and not any('"loss_scale"' in row for row in rows)  # fairseq's bf16 path has no loss scaler
    buffers = {k: v for k, v in state["model"].items() if ".running_" in k}
    assert buffers and all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in buffers.values())
    fp32 = _curve(cli("fairseq-train", *train_args(toy_data, tmp_path / "fp32", *common, max_update=16)).stdout)
    assert len(fp32) == len(curve) and fp32 != curve
    assert max(abs(a - b) for a, b in zip(fp32, curve)) < 0.5, (fp32, curve)
