"""powernorm-fairseq: Power Normalization and its neighbours as a fairseq plugin.

Pass ``--user-dir`` pointing at this package to any fairseq command; importing
it registers the ``powernorm_transformer`` and ``powernorm_transformer_lm``
models and their architectures.
"""

from .checkpoints import (
    allow_fairseq_checkpoints,
    atomic_checkpoint_copies,
    name_failed_saves,
    name_unreadable_checkpoints,
    resume_with_the_same_batches,
)
from .compat import bf16_without_tpu, numpy_compat_long
from .datafiles import check_binarized_data
from .errors import install_excepthook, one_line_usage_errors
from .savedir import guard_training_runs
from .shutdown import install as install_clean_exit

__version__ = "0.1.0"

allow_fairseq_checkpoints()
name_unreadable_checkpoints()
name_failed_saves()
atomic_checkpoint_copies()
guard_training_runs()
check_binarized_data()
resume_with_the_same_batches()
install_excepthook()
one_line_usage_errors()
install_clean_exit()
numpy_compat_long()
bf16_without_tpu()

from . import models  # noqa: E402,F401 (registers the model with fairseq)
