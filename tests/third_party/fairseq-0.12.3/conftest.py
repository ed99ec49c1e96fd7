"""Every change the plugin makes to fairseq, installed before fairseq's own
tests run: they must pass as they do on stock fairseq (the plugin's file, not
fairseq's). POWERNORM_STOCK=1 runs them on fairseq alone, for comparison."""

import os

if os.environ.get("POWERNORM_STOCK") != "1":
    import powernorm_fairseq.models  # noqa: F401  the plugin's architectures, registered
    from powernorm_fairseq import patches

    patches.install(patches.AT_IMPORT + patches.WITH_THE_MODELS)
