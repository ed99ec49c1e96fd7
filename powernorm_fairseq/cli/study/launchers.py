"""Where the cells run: here (``--launcher local``: this process, or a pool of ``--jobs`` processes), or
on a SLURM cluster (``--launcher slurm``, :mod:`.slurm`)."""

from ...common.files import end_cleanly_on_sigterm
from ..launcher import quiet
from .cell import run_cell

#: a cell whose worker process dies this many times (killed, or a crash) ends without a result
STRIKES = 2
#: what the pool's fork server imports once, before it forks each worker: torch, fairseq and its trainer
#: (torch._dynamo, which torch.optim imports as a training builds its optimizer), the plugin and the cell.
#: A worker spawned afresh spent some 5 s of CPU on these imports, and a pool started again after a worker
#: died spent them again; a fork server holds no threads and no CUDA state, so its forks are safe
PRELOAD = ("torch", "torch._dynamo", "fairseq", "fairseq_cli.train", "powernorm_fairseq", __name__)


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
    yield from _pooled(args, todo)


def _pooled(args, todo):
    """The cells in ``--jobs`` worker processes. A worker that dies (the
    system's OOM killer, a crash in a kernel) takes the pool down, and every
    cell it held would otherwise wait forever: the cells that were running
    then are named and each is started again, resuming from its checkpoint, in
    a new pool; one whose worker dies ``STRIKES`` times ends without a result."""
    import sys

    strikes, left = dict.fromkeys((c["name"] for c in todo), 0), list(todo)
    while left:
        hit = []
        for cell, outcome in _one_pool(args, left, hit):
            left.remove(cell)
            yield cell, outcome
        if not hit:
            return
        for name in hit:
            strikes[name] += 1
        print(f"norm-study: a worker process ended abruptly (killed, or a crash) while running "
              f"{', '.join(hit)}; each is started again in a new process and resumes from its checkpoint",
              file=sys.stderr, flush=True)
        for cell in [c for c in left if strikes[c["name"]] >= STRIKES]:
            left.remove(cell)
            yield cell, f"its worker process ended abruptly {STRIKES} times; its train.log says how far it got"


def _one_pool(args, cells, hit):
    """(cell, result) from one pool as each finishes. When a worker dies the
    pool ends: ``hit`` gets the cells it had started (all it held, if none had
    started yet), and the others are left to the caller's next pool."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    pool = ProcessPoolExecutor(args.jobs, mp_context=context, initializer=_worker, initargs=(args.verbose,))
    pending = {pool.submit(run_cell, args, cell, False): cell for cell in cells}
    started, ended = set(), False
    try:
        while pending:
            started |= {f for f in pending if f.running()}  # handed to a worker (the pool keeps one spare)
            done, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            broken = [f for f in done if isinstance(f.exception(), BrokenProcessPool)]
            for job in set(done) - set(broken):
                yield pending.pop(job), job.result()
            if broken:
                held = [f for f in pending if f in started] or list(pending)
                hit.extend(sorted(pending[f]["name"] for f in held))
                ended = True
                return
        ended = True
    finally:
        pool.shutdown(wait=ended, cancel_futures=True)
        if not ended:  # a signal or an error here: the cells under way end with it
            for process in multiprocessing.active_children():
                process.terminate()
            for process in multiprocessing.active_children():
                process.join()


def _worker(verbose):
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the main process ends the pool
    end_cleanly_on_sigterm()
    quiet(verbose)
