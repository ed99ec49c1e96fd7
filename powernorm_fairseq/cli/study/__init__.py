"""The normalization study: one resumable grid of training runs, its tables
and figures (``scripts/norm-study.sh``, docs/study.md).

A cell is one run: task x depth x width x norm x init x learning rate x seed.
Each runs fairseq's own trainer in ``OUT/cells/<name>/`` (its ``train.log``
and ``checkpoint_last.pt``), after measuring the per-layer gradient norms and
the loss of its freshly initialised model (``init.json``); ``result.json``
marks it finished, so a rerun skips it, and an interrupted one resumes from
its last checkpoint. ``study.json`` and ``study.md`` hold one table per depth
x width x init, learning rates as rows and norms as columns, and the figures
go beside them.

A cell *converged* when its final training loss is finite and below both
``--converged-fraction`` times its initial loss and the loss of the best
constant prediction (the training labels' entropy; for translation and
language models the unigram entropy of the training tokens), all in bits.

The package, a job per file: ``grid`` (the axes, cells and their
fairseq-train commands), ``cell`` (one run, resumable), ``probe`` (what a
cell measures besides training), ``launchers`` and ``slurm`` (where cells
run), ``statistics`` (paired intervals), ``report`` and ``figures``,
``out`` (the study's directory), ``options`` (the flags and their checks)
and ``command`` (``norm-study.sh``).
"""

from .command import main

__all__ = ["main"]
