"""Run a recipe script so that a signal ends it whole.

    python scripts/tree.py bash SCRIPT ARGS...

A scheduler's SIGTERM (Slurm's preemption, ``timeout``) or a closed
terminal's SIGHUP reaches one process, the script, and a shell that dies
leaves its children running: a ``powernorm-average`` that writes its output
after the script has gone, a ``fairseq-generate`` that translates to the end.
This runs the script under a process that adopts every orphan of its tree
(Linux's child subreaper, prctl(2)). When the script ends, whatever it left
running is sent SIGTERM (SIGKILL after ``GRACE`` seconds), and the temporary
files that the tree registered are removed: each line of the file named by
``$POWERNORM_TREE`` names one. The exit status is the script's.

Ctrl-C reaches the whole process group from the terminal, as without this
process, which ignores it and waits. The scripts re-run themselves under it
(``whole`` in ``scripts/lib.sh``). Standard library only: it starts before
any environment is checked.
"""

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG = 36, 1
GRACE = 10.0  # seconds a process has to clean up after SIGTERM


def _prctl(option, value):
    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def children():
    """Pids of this process's children (its own and the adopted orphans)."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == me:
                found.append(int(entry))
    return found


def reap():
    """Collect every child that has ended, without waiting."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_the_rest():
    """SIGTERM to every process left (orphans come to this one as they are
    made), then SIGKILL to those still there after GRACE seconds."""
    deadline, sig = time.monotonic() + GRACE, signal.SIGTERM
    signalled = set()
    while pids := children():
        for pid in pids:
            if pid not in signalled or sig == signal.SIGKILL:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
                signalled.add(pid)
        time.sleep(0.05)
        reap()
        if time.monotonic() > deadline:
            sig = signal.SIGKILL


def remove_registered(listing):
    with open(listing, encoding="utf-8", errors="surrogateescape") as f:
        paths = [line.rstrip("\n") for line in f if line.strip()]
    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    os.unlink(listing)


def main(argv):
    if not argv:
        sys.exit("usage: python scripts/tree.py COMMAND ARGS...")
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    fd, listing = tempfile.mkstemp(prefix="powernorm-tree.")
    os.close(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C reaches the script itself
    script = subprocess.Popen(argv, env={**os.environ, "POWERNORM_TREE": listing},
                              preexec_fn=lambda: (signal.signal(signal.SIGINT, signal.SIG_DFL),
                                                  _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)))

    def forward(sig, _frame):
        try:
            script.send_signal(sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    status = script.wait()
    end_the_rest()
    remove_registered(listing)
    if status < 0:  # died of a signal: so does this process, as its caller expects
        sig = -status
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # the two whose handler cannot be set
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        sys.exit(128 + sig)  # what a shell reports for a child ended by the signal: 137 for SIGKILL
    sys.exit(status)


if __name__ == "__main__":
    main(sys.argv[1:])
