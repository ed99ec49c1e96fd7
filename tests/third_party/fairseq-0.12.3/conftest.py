"""Every change the plugin makes to fairseq, installed before fairseq's own
tests run: they must pass as they do on stock fairseq (the plugin's file, not
fairseq's). POWERNORM_STOCK=1 runs them on fairseq alone, for comparison."""

import os

if os.environ.get("POWERNORM_STOCK") != "1":
    import powernorm_fairseq.models  # noqa: F401  the plugin's architectures, registered
    from powernorm_fairseq import patches

    patches.install(patches.AT_IMPORT + patches.WITH_THE_MODELS)


import random  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _the_same_data_each_run():
    """fairseq's tests draw their toy corpora from the unseeded global
    generators (``tests/utils.py``, ``create_dummy_data``): seeded here, each
    test trains on the same data in every run. Unseeded, the latent-depth
    test's tiny model sometimes met non-finite gradients, and fairseq's
    NanDetector then failed inside torch's module hooks."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
