"""Where the cells run: here (``--launcher local``: this process, or a pool of ``--jobs`` processes), or
on a SLURM cluster (``--launcher slurm``, :mod:`.slurm`)."""

import time

from ...common.files import end_cleanly_on_sigterm
from ..launcher import quiet
from .cell import run_cell


def run_all(args, todo):
    """(cell, result) as each finishes; the result is None for a cell another
    process holds, and a line saying why for one that ended without a result."""
    if args.launcher == "slurm":
        from . import slurm

        yield from slurm.run(args, todo)
        return
    if args.jobs == 1 or len(todo) <= 1:
        for cell in todo:
            yield cell, run_cell(args, cell, args.verbose)
        return
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(args.jobs, initializer=_worker, initargs=(args.verbose,)) as pool:
        pending = {pool.apply_async(run_cell, (args, cell, False)): cell for cell in todo}
        while pending:
            for job in [j for j in pending if j.ready()]:
                yield pending.pop(job), job.get()
            time.sleep(0.2)


def _worker(verbose):
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the main process ends the pool
    end_cleanly_on_sigterm()
    quiet(verbose)
