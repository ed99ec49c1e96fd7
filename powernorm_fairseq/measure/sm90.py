"""The Triton kernels as an H100 (sm_90) would run them, checked without one.

:func:`recording` notes every kernel variant the norms launch (its argument
types, alignments, integer values and constexprs), running them or not;
:func:`build` compiles each distinct variant for sm_90 through triton's own
specialisation (what a launch on the GPU would compile) and reads its
registers and spills as ptxas reports them (``ptxas -v``, in triton's own run). It
needs ``TRITON_INTERPRET=0``, so callers on an interpreted process run it in
a fresh one::

    python -m powernorm_fairseq.measure.sm90 VARIANTS.json   # prints JSON

A variant *spills* when ptxas reports spill stores. A main kernel *fits*
when its registers allow the programs per multiprocessor that ``gpu.py``'s
grid launches (``plans.PROGRAMS_PER_SM``) to be resident at once.
"""

import contextlib
import hashlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ..norms.kernels import gpu, gpu_rows, launcher

_ROW_KERNELS = {k.__name__ for k in gpu_rows.KERNELS} if gpu.triton is not None else set()

REGISTERS_PER_SM, WARP = gpu.REGISTERS_PER_SM, gpu.WARP


#: an H100's (sm_90) limits per multiprocessor: shared memory a block may use (228 KB, of which 1 KB is the
#: system's per block), resident blocks and warps
SHARED_PER_SM, SHARED_RESERVED, BLOCKS_PER_SM, WARPS_PER_SM = 233472, 1024, 32, 64


def resident_warps(registers: int, warps: int, shared: int) -> int:
    """Warps of one kernel resident on a multiprocessor at once, as its registers,
    shared memory and the hardware's block and warp limits allow (occupancy)."""
    by_registers = REGISTERS_PER_SM // (_allocated(max(registers, 1)) * WARP * warps)
    by_shared = SHARED_PER_SM // (shared + SHARED_RESERVED)
    return min(by_registers, by_shared, BLOCKS_PER_SM, WARPS_PER_SM // warps) * warps


def _describe(a):
    if isinstance(a, torch.Tensor):
        return {"tensor": str(a.dtype).replace("torch.", ""), "aligned": a.data_ptr() % 16 == 0}
    if isinstance(a, bool):
        return {"bool": a}
    if isinstance(a, int):
        return {"int": a}
    return {"float": float(a)}


@contextlib.contextmanager
def recording(run: bool = True):
    """Note each kernel launch (``launcher.launch``, every launch watched) in the list it yields; with
    ``run=False`` the kernels are not run, though still counted by
    ``launches.counting`` (outputs stay uninitialised: the norms never read
    them on the host, so the launches that follow are those of a real step)."""
    seen = []
    launch = launcher.launch

    def noted(kernel, grid, *args, **constexprs):
        name = getattr(kernel, "__name__", None) or kernel.fn.__name__
        programs = grid if isinstance(grid, int) else math.prod(grid)
        fn = kernel if hasattr(kernel, "arg_names") else kernel.fn
        seen.append({"kernel": name, "args": [_describe(a) for a in args], "constexprs": constexprs,
                     "programs": programs, "grid": list(grid) if not isinstance(grid, int) else [grid],
                     "ints": {k: a for k, a in zip(fn.arg_names, args) if type(a) is int}})
        if run:
            launch(kernel, grid, *args, **constexprs)
        else:
            with launcher.observed(name):  # counted all the same
                pass

    launcher.launch = noted
    try:
        with launcher.watching():
            yield seen
    finally:
        launcher.launch = launch


def activation_tensors(variant) -> int:
    """Activation-sized (N, C) tensors a launch reads or writes: the model of
    the bytes it moves (LayerNorm's minimum per forward + backward is 5: read
    x, write y; read x and dy, write dx)."""
    c, name = variant["constexprs"], variant["kernel"]
    if name == "_channel_forward":
        return 1 + int(c["WANT_Y"])
    if name == "_channel_backward":
        return 2 + int(c["WANT_GX"])
    if name in _ROW_KERNELS and name.endswith("_forward"):  # a row kind's: read x, write y
        return 2
    if name in _ROW_KERNELS and name.endswith("_backward"):  # read x and dy, write dx
        return 3
    return 0  # the finishing kernels read per-program sums, not activations


#: per-program sums a finishing kernel reads per row of its part, and the columns each extra-committing
#: last program reads and writes besides (its running buffers, nu)
_FINISHING = {"_finish_stats": (3, 4), "_finish_backward": (5, 2), "_sum_columns": (1, 0)}


def balance(variant) -> float:
    """The bytes the busiest program of a launch moves over the mean
    program's, modelled from its plan: a main kernel's programs each cover
    ``per_prog`` rows of a chunk of columns (some past the last row cover
    none); a finishing program adds its block of columns over the part's rows,
    and the last to arrive of a finishing or row-backward kernel also commits
    the buffers of every channel, or adds the programs' scalar sums."""
    name, n, programs = variant["kernel"], variant["ints"], variant["programs"]
    if name in _FINISHING:
        sums, extra = _FINISHING[name]
        rows = n.get("P", n.get("rows", 1))
        block = variant["constexprs"]
        mean = rows * sums * min(n["C"], block["BLOCK"]) * (2 if block.get("TWO") else 1)
        return (mean + extra * n["C"]) / mean
    N, C, per_prog = n["N"], n["C"], n["per_prog"]
    width = n.get("cw", C) if name.startswith("_channel") else C
    mean = N * C / programs  # elements a program moves, on average
    extra = programs if name in gpu_rows.SCALAR_SUMS else 0  # the last one's scalar sums
    return (min(per_prog, N) * width + extra) / mean


def distinct(variants):
    """The variants with distinct descriptions (the same description always specialises alike)."""
    out = {}
    for v in variants:
        v = {k: x for k, x in v.items() if k not in ("programs", "grid", "ints")}  # the launch's, not the variant's
        out.setdefault(json.dumps(v, sort_keys=True), v)
    return list(out.values())


def _argument(d):
    if "tensor" in d:
        t = torch.empty(8, dtype=getattr(torch, d["tensor"]))
        return t if d["aligned"] else t[1:]
    return next(iter(d.values()))


def _resources(log: str):
    """(registers, spill store bytes, stack frame bytes) from ptxas's -v log."""
    import re

    def number(pattern):
        found = re.search(pattern, log)
        return int(found.group(1)) if found else 0
    return number(r"Used (\d+) registers"), number(r"(\d+) bytes spill stores"), number(r"(\d+) bytes stack frame")


def _compile(job):
    """Compile one specialisation for sm_90: (registers, local bytes, stack bytes, warps, shared bytes,
    the parameters as the C++ node passes them, checked against the kernel's PTX (``launcher.layout``))."""
    import triton
    from triton.compiler import ASTSource

    name, signature, constexprs, attrs, options, given = job
    fn = gpu.KERNELS[name]
    log = io.StringIO()  # ptxas's own -v report, as triton prints it (build sets dump_ptxas_log)
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                target=TARGET(), options=options)
    return (*_resources(log.getvalue()), kernel.metadata.num_warps, kernel.metadata.shared,
            launcher.layout(kernel, given), launcher.ptx_params(kernel.asm["ptx"], kernel.name))


def _portable(options) -> list:
    """The compile options as a key that names each library by its file, not by where this environment
    keeps it (libdevice's path is inside the virtual environment; the same triton, whose version is in the
    kept reports' key, ships the same file): another checkout on the machine finds the reports kept."""
    items = dict(options.__dict__)
    if items.get("extern_libs"):
        items["extern_libs"] = tuple((name, Path(path).name) for name, path in items["extern_libs"])
    return sorted(map(str, items.items()))


def TARGET():
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


def build(variants, workers=None):
    """Compile each distinct specialisation for sm_90 once (``workers``
    processes, default one per core): for each of ``variants``, a dict with
    the kernel, its signature and constexprs, registers, spill-store and
    stack-frame bytes, warps, shared memory, the warps resident per SM
    (:func:`resident_warps`), and (main kernels) the programs per SM its
    registers allow (``resident_per_sm``) and the grid launches (``launched_per_sm``)."""
    assert not gpu.interpreting(), "sm90.build needs TRITON_INTERPRET=0"
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    knobs.nvidia.dump_ptxas_log = True  # the workers read each kernel's registers from triton's own ptxas run
    backend = make_backend(TARGET())
    keys, jobs, described = [], {}, {}
    for v in variants:  # triton's own specialisation of each launch, as on the GPU
        fn = gpu.KERNELS[v["kernel"]]
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*[_argument(d) for d in v["args"]], **v["constexprs"])
        options, signature, constexprs, attrs = fn._pack_args(backend, v["constexprs"], bound, specialization,
                                                              options)
        key = json.dumps([v["kernel"], signature, sorted(map(str, constexprs.items())), sorted(map(str, attrs)),
                          _portable(options)])  # maxnreg and warps among the options
        keys.append(key)
        if key not in jobs:
            jobs[key] = (v["kernel"], signature, constexprs, attrs, options.__dict__, len(v["args"]))
            described[key] = dict(
                kernel=v["kernel"], signature={k: str(t) for k, t in signature.items() if t != "constexpr"},
                constexprs={fn.arg_names[k[0]] if isinstance(k, tuple) else str(k): c
                            for k, c in constexprs.items() if not isinstance(c, (tuple, list))})
    import triton

    # each compile's report, kept by content (the kernel's source and its callees', the specialisation,
    # triton's version): a variant is compiled once per machine, not on every run
    kept = {key: KEPT / (hashlib.sha256(f"{gpu.KERNELS[jobs[key][0]].cache_key}{key}{triton.__version__}".encode())
                         .hexdigest()[:24] + ".json") for key in jobs}
    reports = {key: json.loads(kept[key].read_text()) for key in jobs if kept[key].is_file()}
    todo = [key for key in jobs if key not in reports]
    if todo:
        KEPT.mkdir(parents=True, exist_ok=True)
        with ProcessPoolExecutor(workers or os.cpu_count(), mp_context=get_context("fork")) as pool:
            for key, report in zip(todo, pool.map(_compile, [jobs[key] for key in todo])):
                reports[key] = list(report)
                partial = kept[key].with_suffix(f".{os.getpid()}.tmp")
                partial.write_text(json.dumps(reports[key]))
                os.replace(partial, kept[key])
    for key in jobs:
        regs, spilled, stack, warps, shared, laid, sizes = reports[key]
        row = described[key]
        row.update(registers=regs, spill_bytes=spilled, stack_bytes=stack, warps=warps, shared_bytes=shared,
                   resident_warps=resident_warps(regs, warps, shared), layout=laid, ptx_sizes=sizes)
        if row["kernel"] in gpu.KERNELS:  # how many programs fit at once, and how many the grid has
            row["resident_per_sm"] = REGISTERS_PER_SM // (_allocated(regs) * WARP * warps)
            row["launched_per_sm"] = gpu.programs_per_sm(row["kernel"], bool(row["constexprs"].get("F64")))
    return [described[key] for key in keys]


#: where each variant's compile report is kept (``build``)
KEPT = Path(tempfile.gettempdir()) / "powernorm-sm90"


def _allocated(regs: int) -> int:
    """Registers per thread as the hardware allocates them (in units of 8)."""
    return -(-regs // 8) * 8


def build_in_fresh_process(variants, timeout=900):
    """:func:`build` in a process of its own (triton compiles only when not interpreting), with a
    kernel cache of its own: a variant not reported yet (``KEPT``) is compiled, so ptxas reports on it."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "variants.json"
        path.write_text(json.dumps(variants))
        # a cache of its own: compiling is what it measures, the same on every machine
        env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(Path(tmp) / "cache")}
        proc = subprocess.run([sys.executable, "-m", __name__, str(path)], capture_output=True, text=True,
                              env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"compiling the kernels for sm_90 failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


if __name__ == "__main__":
    print(json.dumps(build(json.loads(Path(sys.argv[1]).read_text()))))
