"""A diverged training says so, with the update it diverged at.

When a step's gradients are not finite, fairseq's ``Trainer.train_step``
reruns the step under its ``NanDetector`` to log the first module whose
output or gradient is NaN/Inf, then raises ``FloatingPointError("gradients
are Nan/Inf")``. On torch >= 2 the detector's module backward hooks
(``register_backward_hook``) fail inside torch's hook machinery on a module
whose output holds no tensor at its top level (fairseq's encoder returns a
dict of lists): a ``StopIteration`` replaces fairseq's message. Here the
detector watches the gradient of each module's outputs with tensor hooks,
which torch runs for any output structure, and the error names the update.
"""

import functools

import torch

from ..common.errors import TrainingDiverged
from .base import installs_once


def _tensors(value):
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


@installs_once
def nan_detector_on_current_torch():
    """fairseq's NanDetector with its backward check on the gradients of each module's outputs."""
    from fairseq.nan_detector import NanDetector

    def add_hooks(self, module):
        if self.forward or self.backward:
            self.fhooks.append(module.register_forward_hook(self.fhook_fn))

    def fhook_fn(self, module, inp, output):
        if self.forward and not self.has_printed_f:
            self._apply(module, inp, output, backward=False)
        if self.backward and torch.is_grad_enabled():
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(functools.partial(_gradient, self, module))

    NanDetector.add_hooks = add_hooks
    NanDetector.fhook_fn = fhook_fn


def _gradient(detector, module, grad):
    if not detector.has_printed_b:
        detector._apply(module, None, grad, backward=True)


@installs_once
def name_the_diverged_update():
    """fairseq's FloatingPointError of a step (gradients NaN/Inf, or fp16's minimum loss scale) as one line
    naming the update it happened at."""
    from fairseq.trainer import Trainer

    step = Trainer.train_step

    @functools.wraps(step)
    def train_step(self, samples, raise_oom=False):
        try:
            return step(self, samples, raise_oom)
        except FloatingPointError as err:
            if isinstance(err, TrainingDiverged):
                raise
            raise TrainingDiverged(f"the training diverged at update {self.get_num_updates() + 1}: {err} "
                                   "(fairseq's NanDetector logs the first module with a NaN/Inf in train.log; "
                                   "a lower --lr, a longer --warmup-updates or --clip-norm may help)") from err

    Trainer.train_step = train_step
