"""A GPU's launches without a GPU: Triton's real CUDA launch path on a stand-in driver.

:func:`activate` builds ``standin_cuda.c`` into a ``libcuda.so.1`` of its own
(``cc``, cached by the source's digest), loads it, and makes Triton's
``CudaDriver`` the active one on this CPU machine, with an H100's attributes:
each kernel compiles for sm_90 (Triton's own compiler and ptxas), and each
launch runs Triton's whole launch path (the binder, the cache key, the C
launcher, its driver calls) and ``cuLaunchKernelEx``, which records it and
returns at once. CPU tensors stand in for the device's memory; no kernel
runs, so what a step computes is not read. The norms' Triton path takes CPU
tensors meanwhile (``gpu.stand_in``), with grids for 132 multiprocessors.

It needs ``TRITON_INTERPRET=0``, read when triton's kernels are defined, so
a process that interprets them runs this in a fresh one::

    python -m powernorm_fairseq.measure.standin [--rounds 3]   # prints JSON rows

Each row is one kind's training step at a shape, beside ``nn.LayerNorm``'s
in the same run (``measure/host.py``): its time as a ratio to LayerNorm's, the
median of the interleaved rounds beside their least, its Python calls as a
ratio to LayerNorm's, and the launches it recorded.
"""

import ctypes
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from ..common.flags import ArgumentParser
from ..norms.kernels.contract import ROW_KINDS
from ..norms.kernels.launcher import ptx_params

SOURCE = Path(__file__).with_name("standin_cuda.c")
MULTIPROCESSORS = 132  # an H100 SXM's, as the stand-in reports
SHAPES = ((4, 4, 64), (8, 8, 64))
_LIB = None


class Launch(NamedTuple):
    kernel: str
    function: int  # which compiled variant: one function per module the driver loaded, numbered in order
    grid: tuple
    block: tuple
    shared: int
    stream: int
    params: int  # how many (-1: the kernel's were not registered)
    sizes: tuple  # each parameter's bytes, as the compiled variant's PTX declares them
    data: bytes  # every parameter's bytes, in order


def build() -> Path:
    """The stand-in's ``libcuda.so.1``, compiled once per source and triton (whose ``cuda.h`` it takes)."""
    import triton

    include = Path(triton.__file__).parent / "backends" / "nvidia" / "include"
    digest = hashlib.sha256(SOURCE.read_bytes() + triton.__version__.encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"powernorm-standin-cuda-{digest}"
    lib = folder / "libcuda.so.1"
    if not lib.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".libcuda.{os.getpid()}.so"
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", f"-I{include}", "-Wl,-soname,libcuda.so.1", "-o", str(tmp),
                        str(SOURCE)], check=True, capture_output=True, text=True)
        os.replace(tmp, lib)
    return lib


def activate():
    """Load the stand-in and make Triton's CUDA driver the active one on this
    machine; the norms' Triton path then takes CPU tensors. Returns the library."""
    global _LIB
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("the stand-in driver needs TRITON_INTERPRET=0 (run this module in a fresh process)")
    if _LIB is not None:
        return _LIB
    lib = build()
    os.environ["TRITON_LIBCUDA_PATH"] = str(lib.parent)  # where triton links its launcher's module
    _LIB = ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)  # its dlopen("libcuda.so.1") finds this one
    import triton
    from triton.backends.nvidia.driver import CudaDriver
    from triton.compiler.compiler import CompiledKernel

    driver = CudaDriver()
    # the driver's own device and stream, not torch.cuda's (this torch has no CUDA)
    driver.get_current_device, driver.set_current_device = driver._get_current_device, driver._set_current_device
    driver.get_current_stream = driver._get_current_stream
    driver.get_device_capability = driver._get_device_capability
    triton.runtime.driver.set_active(driver)
    init_handles = CompiledKernel._init_handles

    def _init_handles(self):  # each compiled kernel's parameters, from its PTX, before its first launch
        if self.module is None:
            register(self.name, self.asm["ptx"])
        return init_handles(self)

    CompiledKernel._init_handles = _init_handles
    from ..norms.kernels import gpu

    gpu.stand_in(MULTIPROCESSORS)
    return _LIB


def register(name: str, ptx: str):
    """Tell the stand-in the parameter sizes of the compiled variant of kernel ``name``
    whose function it gives next, so that it records their bytes."""
    sizes = ptx_params(ptx, name)
    array = (ctypes.c_int * len(sizes))(*sizes)
    if _LIB.standin_set_params(name.encode(), len(sizes), array) != 0:
        raise RuntimeError(f"the stand-in driver cannot hold the parameters of {name}")


def launches() -> list:
    """Every launch recorded since the last :func:`clear`."""
    out = []
    name, grid, block = ctypes.create_string_buffer(128), (ctypes.c_uint * 3)(), (ctypes.c_uint * 3)()
    shared, stream, n, size = ctypes.c_uint(), ctypes.c_uint64(), ctypes.c_int(), ctypes.c_int()
    function, sizes, data = ctypes.c_int(), (ctypes.c_int * 64)(), ctypes.create_string_buffer(1024)
    for i in range(_LIB.standin_launches()):
        _LIB.standin_launch(i, name, ctypes.byref(function), grid, block, ctypes.byref(shared), ctypes.byref(stream),
                            ctypes.byref(n), sizes, data, ctypes.byref(size))
        out.append(Launch(name.value.decode(), function.value, tuple(grid), tuple(block), shared.value,
                          stream.value, n.value, tuple(sizes[:max(n.value, 0)]), data.raw[:size.value]))
    if _LIB.standin_dropped():
        raise RuntimeError(f"the stand-in driver dropped {_LIB.standin_dropped()} launches (it holds 4096)")
    return out


def clear():
    _LIB.standin_clear()


def measure(kinds, rounds: int = 20, reps: int = 40, shapes=SHAPES) -> list:
    """Rows (kind, shape, step / LN as the median and the least of the rounds, calls / LN, launches) of
    each kind's training step on the Triton path under the stand-in, beside ``nn.LayerNorm``'s."""
    from ..norms import kernels
    from . import host

    activate()
    rows = []
    for shape in shapes:
        with kernels.use("triton"):
            for kind in kinds:  # the launches of one step, after the first (compiling) ones
                run = host.step(kind, shape)
                run()
                clear()
                run()
                rows.append(dict(kind=kind, shape="x".join(map(str, shape)), launches=len(launches())))
            measured = host.measure_with(["nn.LayerNorm", *kinds], kinds, shape, rounds, reps)
        ln_calls = measured["nn.LayerNorm"][0]
        for row in rows[-len(kinds):]:
            calls, median, least = measured[row["kind"]]
            row.update(step_ratio=round(median, 2), step_least=round(least, 2), calls=calls,
                       calls_ratio=round(calls / ln_calls, 2))
    return rows


def main(argv=None):
    p = ArgumentParser(prog="python -m powernorm_fairseq.measure.standin", description=__doc__.split("\n")[0])
    p.add_argument("--kinds", nargs="+", default=["pn", "bn", "pn-v", *ROW_KINDS],
                   help="the norms to measure (default: each with kernels of its own)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--reps", type=int, default=40)
    args = p.parse_args(argv)
    print(json.dumps(measure(args.kinds, args.rounds, args.reps)))


if __name__ == "__main__":
    sys.exit(main())
