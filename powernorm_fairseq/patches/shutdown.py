"""A clean exit for fairseq commands.

fairseq prefetches batches in a daemon thread (``BackgroundConsumer`` of
``fairseq/data/iterators.py``, on whenever ``--data-buffer-size`` > 0, the
default). When a command ends while that thread is inside torch (collating the
next batch), Python 3.11 stops the thread during interpreter finalisation by
unwinding it through torch's C++ frames, and the process aborts with
"terminate called without an active exception" and exit status 134 after
the run is complete (observed in about one run in six of a short CPU
training). Before finalisation this stops every such thread: it caps the
thread's batch count so that it leaves its loop after the batch in hand, and
drains the queue it may be blocked on.

A distributed run aborts the same way. fairseq ends it with a barrier on its
own group of all ranks (``get_global_group``, cached on the function) and
destroys no group. A gloo group's worker thread releases a finished work
(the barrier, and the all-reduces it waited for, whose tensors belong to
Python) just after the caller's wait returns; when that falls during
finalisation, the thread dies taking the GIL inside torch's C++ frames (a
core dump of the non-master rank of a two-process CPU run shows it). Here
every group is destroyed and fairseq's reference dropped before
finalisation, so that each group's destructor, which releases the GIL, waits
for its worker threads.
"""

import atexit
import gc
import queue
import threading

from .base import installs_once

JOIN_SECONDS = 10.0


def stop_background_loaders(timeout: float = JOIN_SECONDS):
    from fairseq.data.iterators import BackgroundConsumer

    for thread in threading.enumerate():
        if not isinstance(thread, BackgroundConsumer) or not thread.is_alive():
            continue
        thread._max_len = 0  # the loop breaks after its current put
        for _ in range(int(timeout / 0.05)):
            try:
                while True:
                    thread._queue.get_nowait()
            except queue.Empty:
                pass
            thread.join(0.05)
            if not thread.is_alive():
                break


def destroy_process_group():
    import torch.distributed as dist
    from fairseq.distributed.utils import get_global_group

    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.destroy_process_group()
    # fairseq keeps its own group of all ranks (its final barrier runs on it);
    # dropped here, the group's destructor waits for its worker threads
    if hasattr(get_global_group, "_global_group"):
        del get_global_group._global_group
    gc.collect()


def clean_exit():
    stop_background_loaders()
    destroy_process_group()


@installs_once
def install():
    atexit.register(clean_exit)
