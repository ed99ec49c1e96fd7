"""gradcheck of every norm (or phase) whose gradient is exact, on each backend.
The Triton kernels run under Triton's interpreter, where the full check's
hundreds of calls took 15-25 s a norm: theirs is gradcheck's fast mode (the
Jacobian against random vectors on both sides, a handful of calls), which a
wrong gradient fails all the same, all but surely."""

import pytest
import torch

from support import backend_or_fail
from powernorm_fairseq.norms import build_norm, kernels
from test_norms import C, affine, batch

pytestmark = pytest.mark.fast


def _exact(kind):
    """Norms (or phases) whose gradient is the exact one, for gradcheck."""
    if kind == "pn":  # PN during warmup is PN-V with a hand-written exact backward
        return build_norm("pn", C, warmup_updates=10**9).double()
    return build_norm(kind, C, **({"momentum": 0.1} if kind in ("bn", "pn-v") else {})).double()


#: the kinds whose training step runs on the kernel backends; the others are plain PyTorch on every one
KERNEL_KINDS = ["bn", "pn-v", "pn", "bn-original", "scalenorm", "rmsnorm", "dyt", "derf"]
CASES = ([("plain", kind) for kind in KERNEL_KINDS + ["ln", "layernorm-simple", "groupnorm", "none"]]
         + [("cpu", kind) for kind in KERNEL_KINDS]
         + [pytest.param("triton", kind, marks=pytest.mark.slow) for kind in KERNEL_KINDS])


@pytest.mark.parametrize("backend, kind", CASES)
def test_gradcheck_exact_gradients(kind, backend):
    backend_or_fail(backend)
    norm = affine(_exact(kind)).train()
    x, pad, _ = batch(70, T=4, B=2)  # 8 rows, one of them padding
    assert pad.sum() == 1
    x.requires_grad_(True)
    with kernels.use(backend):
        assert torch.autograd.gradcheck(lambda inp: norm(inp, pad), (x,), fast_mode=backend == "triton")
