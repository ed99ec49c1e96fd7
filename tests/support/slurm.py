"""A real one-node SLURM cluster on this machine, for the study's SLURM
launcher: Debian's slurm-wlm and munge (``.ci/run`` installs them when they
are missing), started as root with ``ProctrackType=proctrack/linuxproc`` and
``TaskPlugin=task/none``, one node with this machine's CPUs, its
configuration, state and logs in a directory of the test's own."""

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

CONF = """\
ClusterName=study
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobRequeue=1
# scancel's SIGTERM, then SIGKILL this many seconds later (a cluster's default is 30)
KillWait=2
MinJobAge=600
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
NodeName={host} CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName=study Nodes=ALL Default=YES MaxTime=INFINITE State=UP
# a partition that is down: its jobs pend (reason PartitionDown)
PartitionName=down Nodes=ALL MaxTime=INFINITE State=DOWN
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unavailable():
    """Why a cluster cannot start here, or None."""
    if os.geteuid() != 0:
        return "a one-node SLURM cluster needs root (munged and slurmd run as root; CI runs as root)"
    missing = [t for t in ("slurmctld", "slurmd", "munged", "sbatch", "squeue", "scancel") if not shutil.which(t)]
    if missing:
        return f"no {missing[0]} here: .ci/run installs Debian's slurm-wlm and munge with apt-get"
    return None


MUNGED_PID = Path("/run/munge/munged.pid")
#: the clusters of this machine's test runs that use munged (pytest's workers each start one), and whether
#: a test started munged: the last cluster to stop stops it
USERS = Path(tempfile.gettempdir()) / "powernorm-test-munge"


def munge(root):
    """munged running, with a key; registered as used by the cluster in ``root``."""
    from filelock import FileLock

    USERS.mkdir(exist_ok=True)
    with FileLock(str(USERS) + ".lock"):
        (USERS / str(Path(root).resolve()).replace("/", "_")).touch()
        if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
            return
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            subprocess.run(["mungekey", "--create", "--force"], check=True)
            shutil.chown(key, "munge", "munge")
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True)
        (USERS / ".started").touch()


def unmunge(root):
    """The cluster in ``root`` no longer uses munged; the last one stops it, where a test started it."""
    from filelock import FileLock

    with FileLock(str(USERS) + ".lock"):
        (USERS / str(Path(root).resolve()).replace("/", "_")).unlink(missing_ok=True)
        if (USERS / ".started").exists() and not [p for p in USERS.iterdir() if p.name != ".started"]:
            try:
                os.kill(int(MUNGED_PID.read_text()), 15)
            except (OSError, ValueError):
                pass
            (USERS / ".started").unlink()


def start(root):
    """Start the cluster in ``root``; the environment its clients need (``SLURM_CONF``)."""
    why = unavailable()
    if why:
        pytest.skip(why)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    munge(root)
    for d in ("state", "spool"):
        (root / d).mkdir(parents=True, exist_ok=True)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2 ** 20 // 2
    conf = root / "slurm.conf"
    conf.write_text(CONF.format(host=socket.gethostname().split(".")[0], root=root, cpus=os.cpu_count(),
                                memory=memory, ctld_port=free_port(), d_port=free_port()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    subprocess.run(["slurmctld", "-f", str(conf)], check=True, env=env)
    subprocess.run(["slurmd", "-f", str(conf)], check=True, env=env)
    deadline = time.time() + 60
    while time.time() < deadline:
        state = subprocess.run(["sinfo", "--noheader", "--format", "%T"], capture_output=True, text=True, env=env)
        if state.stdout.strip() == "idle":
            return env
        time.sleep(0.5)
    logs = "".join(p.read_text()[-1500:] for p in (root / "slurmctld.log", root / "slurmd.log") if p.exists())
    stop(root)
    raise AssertionError(f"the one-node cluster did not come up:\n{logs}")


def stop(root):
    """Cancel every job, and stop the cluster's daemons."""
    env = {**os.environ, "SLURM_CONF": str(Path(root, "slurm.conf"))}
    subprocess.run(["scancel", "--me"], env=env, capture_output=True)
    for pid in ("slurmd.pid", "slurmctld.pid"):
        path = Path(root, pid)
        if path.exists():
            try:
                os.kill(int(path.read_text()), 15)
            except (ProcessLookupError, ValueError):
                pass
    unmunge(root)
