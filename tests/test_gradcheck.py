"""gradcheck of every norm (or phase) whose gradient is exact, on each backend
(the Triton kernels under Triton's interpreter, hundreds of calls: slow)."""

import pytest
import torch

from conftest import backend_or_fail
from powernorm_fairseq.norms import build_norm, kernels
from test_norms import C, affine, batch

pytestmark = pytest.mark.fast


def _exact(kind):
    """Norms (or phases) whose gradient is the exact one, for gradcheck."""
    if kind == "pn":  # PN during warmup is PN-V with a hand-written exact backward
        return build_norm("pn", C, warmup_updates=10**9).double()
    return build_norm(kind, C, **({"momentum": 0.1} if kind in ("bn", "pn-v") else {})).double()


@pytest.mark.parametrize("backend", ["plain", "cpu", pytest.param("triton", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["ln", "scalenorm", "bn", "pn-v", "pn", "bn-original", "rmsnorm",
                                  "layernorm-simple", "groupnorm", "dyt", "none"])
def test_gradcheck_exact_gradients(kind, backend):
    backend_or_fail(backend)
    norm = affine(_exact(kind)).train()
    x, pad, _ = batch(70, T=5, B=3)
    x.requires_grad_(True)
    with kernels.use(backend):
        assert torch.autograd.gradcheck(lambda inp: norm(inp, pad), (x,))
