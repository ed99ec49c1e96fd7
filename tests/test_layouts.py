"""The norm library outside fairseq: every norm in the three input layouts
(fairseq's (T, B, C) with its padding mask, batch-first (B, T, C) with
HuggingFace's attention mask, (N, C) tokens), masks of other dtypes, and one
set of option names."""

import re

import pytest
import torch

from powernorm_fairseq.norms import NORM_TYPES, build_norm

pytestmark = pytest.mark.fast

T, B, C = 7, 4, 8
OPTIONS = {"pn": dict(warmup_updates=1, layer_scale=True, groups=2), "groupnorm": dict(groups=2)}
#: statistics over every position, padding included, by design (the released code's BN)
PADDING_IN_STATS = {"bn-original"}


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, B, C, generator=g, dtype=torch.float64) * 2 + 0.5
    lengths = torch.tensor([7, 5, 3, 6])
    pad = torch.arange(T)[None, :] >= lengths[:, None]  # (B, T), True at padding
    grad = torch.randn(T, B, C, generator=g, dtype=torch.float64) * (~pad).t()[..., None]
    return x, pad, grad


def run(norm, layout, x, pad, grad):
    """One training step in ``layout``; y and dL/dx at the real tokens, in (T, B)-major token order."""
    real = ~pad.t()  # (T, B)
    if layout == "tbc":
        xi = x.clone().requires_grad_(True)
        y = norm(xi, pad)
        y.backward(grad)
        return y[real], xi.grad[real]
    if layout == "btc":
        xi = x.transpose(0, 1).contiguous().requires_grad_(True)
        y = norm(xi, batch_first=True, attention_mask=(~pad).long())
        y.backward(grad.transpose(0, 1))
        return y.transpose(0, 1)[real], xi.grad.transpose(0, 1)[real]
    xi = x[real].clone().requires_grad_(True)  # (N, C): the real tokens alone
    y = norm(xi)
    y.backward(grad[real])
    return y, xi.grad


@pytest.mark.parametrize("kind", NORM_TYPES)
def test_every_layout_gives_the_same_outputs_gradients_and_buffers(kind):
    layouts = ["tbc", "btc"] + ([] if kind in PADDING_IN_STATS else ["nc"])
    torch.manual_seed(0)
    norms = {lay: build_norm(kind, C, **OPTIONS.get(kind, {})).double() for lay in layouts}
    for lay in layouts[1:]:
        norms[lay].load_state_dict(norms["tbc"].state_dict())
    for step in range(3):  # PN: a warmup step, then Algorithm 2
        x, pad, grad = batch(step)
        got = {lay: run(norms[lay], lay, x, pad, grad) for lay in layouts}
        for lay in layouts[1:]:
            for what, a, b in zip(("y", "dL/dx"), got["tbc"], got[lay]):
                torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=f"{kind} {lay} step {step}: {what}")
            for (name, a), (_, b) in zip(norms["tbc"].named_parameters(), norms[lay].named_parameters()):
                torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=f"{kind} {lay}: {name}.grad")
            for (name, a), (_, b) in zip(norms["tbc"].named_buffers(), norms[lay].named_buffers()):
                torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=f"{kind} {lay}: {name}")
        for n in norms.values():
            n.zero_grad()
    x, pad, grad = batch(9)
    for n in norms.values():
        n.eval()
    with torch.no_grad():
        ys = {lay: run_eval(norms[lay], lay, x, pad) for lay in layouts}
    for lay in layouts[1:]:
        torch.testing.assert_close(ys[lay], ys["tbc"], rtol=1e-10, atol=1e-12, msg=f"{kind} {lay}: eval")


def run_eval(norm, layout, x, pad):
    real = ~pad.t()
    if layout == "tbc":
        return norm(x, pad)[real]
    if layout == "btc":
        return norm(x.transpose(0, 1), batch_first=True, attention_mask=~pad).transpose(0, 1)[real]
    return norm(x[real])


def test_an_integer_padding_mask_gives_the_statistics_of_the_bool_one():
    """``~`` on an integer mask flips bits: it used to read a 0/1 mask as all padding-and-real."""
    x, pad, _ = batch(0)
    for kind in ("bn", "pn-v", "pn"):
        a, b = build_norm(kind, C).double(), build_norm(kind, C).double()
        a(x, pad)
        b(x, pad.to(torch.int64))
        for (name, u), (_, v) in zip(a.named_buffers(), b.named_buffers()):
            torch.testing.assert_close(v, u, msg=f"{kind}: {name}")
        c = build_norm(kind, C).double()
        c(x.transpose(0, 1), batch_first=True, attention_mask=(~pad).to(torch.uint8))
        torch.testing.assert_close(c.state_dict()["running_var" if kind == "bn" else "running_psi2"],
                                   a.state_dict()["running_var" if kind == "bn" else "running_psi2"])


@pytest.mark.parametrize("mask, name", [
    (lambda pad: pad.long() * 2, "pad_mask"),  # not 0/1
    (lambda pad: torch.where(pad, float("-inf"), 0.0), "pad_mask"),  # an additive mask
])
def test_a_mask_that_is_not_zero_one_is_refused_in_one_line(mask, name):
    x, pad, _ = batch(0)
    norm = build_norm("bn", C).double()
    with pytest.raises(ValueError, match=rf"^{name} of dtype \w+ holds values other than 0 and 1") as err:
        norm(x, mask(pad))
    assert "\n" not in str(err.value)
    assert torch.equal(norm.running_var, torch.ones(C, dtype=torch.float64))  # nothing updated


def test_shape_mismatches_name_both_shapes_and_the_layout():
    x, pad, _ = batch(0)
    norm = build_norm("pn", C)
    with pytest.raises(ValueError, match=re.escape("attention_mask has shape (7, 4), expected (batch, seq_len) = "
                                                   "(4, 7) for x of shape (4, 7, 8) read as (batch, seq_len, "
                                                   "channels) with batch_first=True")):
        norm(x.transpose(0, 1).float(), batch_first=True, attention_mask=pad.t())
    with pytest.raises(ValueError, match=r"x of shape \(28, 8\) is \(tokens, channels\) and takes no pad_mask"):
        norm(x.reshape(-1, C).float(), pad)
    with pytest.raises(ValueError, match="not both"):
        norm(x.float(), pad, attention_mask=~pad)


def test_one_set_of_option_names():
    """layer_scale for every kind that has it; pn's earlier group_scaling still taken; a wrong option named."""
    for kind in ("bn", "pn-v", "pn"):
        assert build_norm(kind, C, layer_scale=True, groups=2).layer_scale
    assert build_norm("pn", C, group_scaling=True, groups=2).layer_scale
    with pytest.raises(ValueError, match=r"^bn takes no option warmup_updates; its options: momentum, eps, sync, "
                                         r"layer_scale, groups, causal, unit_offset$"):
        build_norm("bn", C, warmup_updates=10)
