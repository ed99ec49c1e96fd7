"""The fused C++ kernels against the plain PyTorch path, in float32."""

import os
import subprocess
import sys

import pytest
import torch

from powernorm_fairseq.norms import build_norm, fused, kernels
from test_norms import C, affine, batch, run


def _run_steps(kind, options, steps=4, dtype=torch.float32):
    norm = affine(build_norm(kind, C, **options).to(dtype)).train()
    outs = []
    for step in range(steps):
        x, pad, grad_y = batch(120 + step, dtype=dtype)
        norm.zero_grad()
        y, gx = run(norm, x, pad, grad_y)
        outs.append((y, gx, [p.grad.clone() for p in norm.parameters()],
                     {k: v.clone() for k, v in norm.state_dict().items()}))
    return outs


@pytest.mark.parametrize("kind, options", [
    ("bn", {}), ("pn-v", {}), ("scalenorm", {}),
    ("pn", {"warmup_updates": 2}), ("pn", {"warmup_updates": 2, "group_scaling": True, "groups": 4}),
    ("pn", {"warmup_updates": 2, "backward": "reference", "group_scaling": True, "groups": 2}),
])
def test_fused_kernels_match_the_plain_path_in_float32(kind, options, monkeypatch):
    if kernels.load() is None:
        pytest.fail(f"the fused kernels did not build: {kernels._failed}")
    fast = _run_steps(kind, options)
    monkeypatch.setattr(fused, "usable", lambda x: False)
    plain = _run_steps(kind, options)
    for (y0, g0, p0, s0), (y1, g1, p1, s1) in zip(fast, plain):
        torch.testing.assert_close(y0, y1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(g0, g1, atol=1e-5, rtol=1e-5)
        for a, b in zip(p0, p1):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        for key in s0:
            torch.testing.assert_close(s0[key], s1[key], atol=1e-5, rtol=1e-5)


def test_kernels_can_be_switched_off():
    code = ("from powernorm_fairseq.norms import kernels, build_norm\n"
            "import torch\n"
            "assert kernels.load() is None and 'POWERNORM_KERNELS=0' in kernels._failed\n"
            "y = build_norm('pn', 8).train()(torch.randn(3, 2, 8))\n"
            "assert torch.isfinite(y).all()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "POWERNORM_KERNELS": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
