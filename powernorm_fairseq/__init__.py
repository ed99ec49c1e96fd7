"""powernorm-fairseq: Power Normalization and its neighbours as a fairseq plugin.

Pass ``--user-dir`` pointing at this package to any fairseq command: fairseq
imports it, and it registers the ``powernorm_transformer`` and
``powernorm_transformer_lm`` models and their architectures. In Python,
importing it registers them too, whether fairseq is imported before it or
after. Imported without fairseq (the norm library ``powernorm_fairseq.norms``,
the console tools), it loads nothing of fairseq and changes nothing;
``patches`` lists what the plugin changes in fairseq, and when.
"""

import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"


class _RegisterAfterFairseq(importlib.abc.MetaPathFinder):
    """Registers the models once ``import fairseq`` has run, for a program that
    imported this package first: fairseq's registries live in its modules."""

    def find_spec(self, name, path=None, target=None):
        if name != "fairseq":
            return None
        sys.meta_path.remove(self)  # find fairseq's own spec, then step aside for good
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            from . import models  # noqa: F401

        spec.loader.exec_module = exec_module
        return spec


if "fairseq" in sys.modules:  # imported by fairseq (--user-dir), or after it: register the models now
    from . import models  # noqa: F401
elif not any(isinstance(f, _RegisterAfterFairseq) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterFairseq())
