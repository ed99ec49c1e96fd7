"""The compiled module of the kernels (``kernels._C``): built, found and loaded here, for the
CPU backend (``cpu.py``: its kernels) and the Triton path (``gpu.py``: its passes and launches), and
the eager route's autograd nodes (``functions.py``).

``pip install`` builds it (``setup.py``, the extension ``kernels._C``), so a
run starts at once. Where that build is missing, was made from another
version of the source, or needs instructions this CPU lacks, it is built on
first use with torch's C++ extension loader and cached per source, torch
build and environment, so only the first process pays the compile (about a
minute). Where no compiler is present the norms run their plain PyTorch path
instead, and the dispatch (``kernels/__init__.py``) says so.
"""

import hashlib
import logging
import os
import platform
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from . import contract

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "norms.cpp"  # the one translation unit: it includes csrc's other files
#: the compiler's flags for a build on first use: one for this machine's CPU (-fno-trapping-math, as in
#: setup.py's build: a tanh vectorizes; values are the same, only FP exception flags are not kept)
JIT_CFLAGS = ["-O3", "-fno-trapping-math", "-march=native", "-fopenmp"]
def build_wait() -> int:
    """How long a process waits for another one's build of the kernels
    (``POWERNORM_BUILD_WAIT``, seconds; a build takes about a minute)."""
    text = os.environ.get("POWERNORM_BUILD_WAIT", "600")
    try:
        seconds = int(text)
    except ValueError:
        seconds = -1
    if seconds < 0:
        raise ValueError(f"POWERNORM_BUILD_WAIT={text!r}: give a whole number of seconds >= 0")
    return seconds
_module = None
failure = None  # why the kernels could not be built, once tried
#: the compiled module once loaded (``load``), read without a call by the steps (a small layer's step is host time)
NODE = None


def load():
    """The compiled module, or None (``failure`` says why) when it cannot be built."""
    global _module, failure, NODE
    if _module is not None or failure is not None:
        return _module
    module = installed()
    if module is not None:
        _module = NODE = module
        return _module
    try:
        from torch.utils.cpp_extension import load as load_extension

        build = build_directory()
        build.mkdir(parents=True, exist_ok=True)
        with _venv_tools_on_path(), _build_lock(build):
            module = load_extension(
                name="powernorm_fairseq_kernels",
                sources=[str(_SOURCE)],
                extra_cflags=JIT_CFLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
                verbose=False,
            )
        contract.check(module, "compiled cpu")  # a module that drifted from the contract is not used
        _module = NODE = module
    except Exception as err:  # no compiler, no ninja, a build error: the caller falls back, loudly
        text = str(err).strip()
        failure = f"{type(err).__name__}: {text.splitlines()[-1] if text else err}"
    return _module


def source_digest() -> str:
    """What setup.py's build records of the source it compiled: every file of csrc/, by name."""
    digest = hashlib.sha256()
    for path in sorted(_SOURCE.parent.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return "src" + digest.hexdigest()[:12]


#: what setup.py builds for, on x86-64 (-march=x86-64-v3): these CPU flags must all be present
X86_64_V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"}


def installed():
    """The kernels ``pip install`` built, or None (logged) where they cannot serve
    or ``POWERNORM_JIT=1`` asks for a build for this machine (-march=native)."""
    if os.environ.get("POWERNORM_JIT", "0") == "1":
        return None
    try:
        if platform.machine() in ("x86_64", "AMD64"):
            flags = set()
            with open("/proc/cpuinfo") as info:
                for line in info:
                    if line.startswith("flags"):
                        flags = set(line.split(":", 1)[1].split())
                        break
            if not X86_64_V3 <= flags:
                logger.info("powernorm_fairseq: this CPU lacks AVX2/FMA: building the CPU kernels for it")
                return None
        from . import _C
    except (ImportError, OSError) as err:  # not built at install, or built against another torch
        logger.debug("powernorm_fairseq: no installed CPU kernels (%s)", err)
        return None
    if getattr(_C, "source", None) != source_digest():
        logger.info("powernorm_fairseq: the installed CPU kernels were built from another csrc/: "
                    "building this one (rerun scripts/setup.sh or pip install to build it at install)")
        return None
    try:
        contract.check(_C, "installed cpu")
    except TypeError as err:
        logger.info("powernorm_fairseq: %s", err)
        return None
    return _C


def build_directory() -> Path:
    """Where torch's loader builds and caches the kernels: under its own root,
    one directory per source, environment and flags, so that two checkouts (or two
    virtual environments) on one machine never build into, or load from, each
    other's directory. (With one directory, torch's loader sees another
    environment's include paths in the build file and rebuilds, each in turn.)"""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    flavour = "cpu" if torch.version.cuda is None else "cu" + torch.version.cuda.replace(".", "")
    source = source_digest()[3:]
    built = f"{sys.prefix}\n{_SOURCE}\n{torch.__version__}\n{' '.join(JIT_CFLAGS)}"
    environment = hashlib.sha256(built.encode()).hexdigest()[:8]
    return (Path(root) / f"py{sys.version_info.major}{sys.version_info.minor}_{flavour}"
            / f"powernorm_fairseq_kernels-{source}-{environment}")


@contextmanager
def _build_lock(build: Path):
    """One build at a time, under a lock that dies with its holder.

    torch's loader guards a build with a file (``lock``) that a killed build
    leaves behind, and the next process then waits for it forever. Processes
    here first take a file lock (``filelock``: an flock, which the system
    releases when its holder exits), and say in one line when they wait for
    one. Holding it, a ``lock`` file can only be one left by a build that was
    killed: it is removed.
    """
    from filelock import FileLock, Timeout

    held = FileLock(build / "powernorm-build.flock", preserve_lock_file=True)
    try:
        held.acquire(timeout=0)
    except Timeout:
        logger.warning("powernorm_fairseq: waiting for another process to build the CPU kernels "
                       "(lock %s, at most %d s)", held.lock_file, build_wait())
        try:  # bounded: past it the caller falls back to the plain path, with a warning
            held.acquire(timeout=build_wait(), poll_interval=0.5)
        except Timeout:
            raise TimeoutError(f"another process has held {held.lock_file} for over {build_wait()} s") from None
    try:
        stale = build / "lock"
        if stale.exists():
            logger.warning("powernorm_fairseq: removing %s, left by a kernel build that was interrupted", stale)
            stale.unlink()
        yield
    finally:
        held.release()


@contextmanager
def _venv_tools_on_path():
    """The build calls `ninja` by name: find the one installed beside this
    interpreter (requirements.txt) even when the environment is not activated."""
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path
