"""A norm's regulariser in fairseq's training loss, whatever the criterion.

Regularized BN (``--norm-type rbn``, ``norms/rbn.py``) adds a penalty to the
loss of each training forward, as its authors' criterion did. Here
``Trainer.train_step`` hands the task a criterion that returns the
criterion's loss plus the model's penalties of that forward, each weighted by
1 / (forwards in this update x workers), so that the regulariser weighs one
update's mean at any world size and update frequency. fairseq then treats it
as the loss: zeroed for a dummy batch, scaled under --fp16, divided by the
sample size. The penalty is logged as ``rbn_penalty``. A model without rbn
trains as before: its criterion is fairseq's own.
"""

import functools

from .base import installs_once


class _Regularized:
    """``criterion`` with the model's penalties added to its loss (the module doc)."""

    def __init__(self, criterion, weight: float):
        self._criterion, self._weight = criterion, weight

    def __call__(self, model, sample, *args, **kwargs):
        from fairseq.logging import metrics

        from ..norms.rbn import regularization

        loss, sample_size, logging_output = self._criterion(model, sample, *args, **kwargs)
        penalty = regularization(model)
        if penalty is not None:
            loss = loss + self._weight * penalty.to(loss)
            metrics.log_scalar("rbn_penalty", penalty.detach(), priority=100, round=4)
        return loss, sample_size, logging_output

    def __getattr__(self, name):
        return getattr(self._criterion, name)


def _has_penalties(model) -> bool:
    from ..norms.rbn import RegularizedBatchNorm

    return any(isinstance(m, RegularizedBatchNorm) for m in model.modules())


@installs_once
def add_norm_regularizers():
    """Trainer.train_step: the task's train_step gets the regularised criterion."""
    from fairseq.trainer import Trainer

    original = Trainer.train_step

    @functools.wraps(original)
    def train_step(self, samples, raise_oom=False):
        penalized = self.__dict__.get("_norm_penalties")
        if penalized is None:  # once per trainer: its model is fixed, and the walk would cost every update
            penalized = self._norm_penalties = _has_penalties(self.model)
        if not penalized:
            return original(self, samples, raise_oom)
        task_step = self.task.train_step
        weight = 1.0 / (max(len(samples), 1) * self.data_parallel_world_size)

        def step(sample, model, criterion, *args, **kwargs):
            return task_step(sample, model, _Regularized(criterion, weight), *args, **kwargs)

        self.task.train_step = step
        try:
            return original(self, samples, raise_oom)
        finally:
            del self.task.train_step

    Trainer.train_step = train_step
