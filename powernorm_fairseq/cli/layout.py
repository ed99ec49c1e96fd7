"""The layout of a command's OUT, its one owner: the study's (``norm-study.sh``) and a table's
(``reproduce.sh``), on either launcher."""

from pathlib import Path


class Out:
    """The layout of a launcher's OUT, its one owner."""

    def __init__(self, out):
        self.root = Path(out)
        self.slurm = self.root / "slurm"  # submitit's scripts, pickles and logs
        self.jobs = self.root / "jobs.json"  # the job ids on the cluster
        self.cells = self.root / "cells"  # the study's cells
        self.runs = self.root / "runs"  # a table's runs

    def cell(self, name):
        return self.cells / name

    def run(self, name):
        return self.runs / name
