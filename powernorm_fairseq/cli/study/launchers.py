"""Where the cells run: in this process, or in a pool of ``--jobs`` processes."""

import time

from ...common.files import end_cleanly_on_sigterm
from .cell import quiet, run_cell


def run_all(args, todo):
    """(cell, result) as each finishes: in this process, or in ``--jobs`` worker processes."""
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
