"""What a GPU would be asked to do, counted on any device: launches and host waits.

GPU speed cannot be timed where no GPU is, but two of the things that set it
can be counted on a CPU, op for op, as the GPU would receive them:

* a *launch* is a PyTorch op that computes (views and allocations left out:
  they launch nothing) or a Triton kernel call. Ops that Triton's interpreter
  issues while it runs a kernel on CPU tensors are not counted: on a GPU they
  are the kernel.
* a *host wait* is anything after which the host cannot go on until the
  device has caught up: reading a value (``.item()``, ``bool()``, ``int()``,
  ``float()`` of a tensor, ``.tolist()``, ``.cpu()``, ``.numpy()``), an op
  whose output size depends on the data (``nonzero``, ``masked_select``), or
  a tensor made from host data (a host-to-device copy on a GPU).

The plugin's own ops (``torch.ops.powernorm``, ``ops.py``) are seen through:
what their implementation launches is what is counted.

    with launches.counting() as seen:
        loss.backward()
    seen.launches, seen.waits  # lists of op names, in order
"""

import contextlib
from dataclasses import dataclass, field
from typing import List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..norms.kernels import launcher, ops

#: ops that allocate or alias without launching anything
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
         "_unsafe_view", "set_", "resize_", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
         "is_same_size", "_has_compatible_shallow_copy_type", "record_stream"}
#: ops that make the host wait for the device
_WAITS = {"_local_scalar_dense", "lift_fresh", "lift_fresh_copy", "nonzero", "masked_select", "unique_consecutive",
          "_unique2", "item"}

_counters: List["Seen"] = []  # the counters in effect, innermost last
_inside_kernel = 0


@dataclass
class Seen:
    launches: List[str] = field(default_factory=list)
    waits: List[str] = field(default_factory=list)

    def kernels(self) -> List[str]:
        return [name for name in self.launches if name.startswith("triton:")]


def _name(func) -> str:
    return func._schema.name.split("::", 1)[-1]


def _crosses_devices(func, args) -> bool:
    """A copy between host and device memory."""
    if _name(func) not in ("_to_copy", "copy_", "to"):
        return False
    devices = {a.device.type for a in args if isinstance(a, torch.Tensor)}
    return len(devices) > 1


class _Mode(TorchDispatchMode):
    def __init__(self, seen: Seen):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _inside_kernel:
            return func(*args, **kwargs)
        if func.namespace == "powernorm":  # see through to what the implementation launches
            with self:
                return ops.implementation(func)(*args, **kwargs)
        name = _name(func)
        if name in _WAITS or _crosses_devices(func, args):
            self.seen.waits.append(name)
        if not func.is_view and name not in _FREE and name not in _WAITS:
            self.seen.launches.append(name)
        return func(*args, **kwargs)


_PATCHED = ("tolist", "cpu", "numpy")


@contextlib.contextmanager
def counting():
    """Count the launches and host waits of the ops run inside the block."""
    seen = Seen()
    originals = {name: getattr(torch.Tensor, name) for name in _PATCHED}

    def waiting(name):
        original = originals[name]

        def method(self, *args, **kwargs):
            if _counters and not _inside_kernel:
                for s in _counters:
                    s.waits.append(name)
            return original(self, *args, **kwargs)
        return method

    _counters.append(seen)
    if len(_counters) == 1:
        for name in _PATCHED:
            setattr(torch.Tensor, name, waiting(name))
        launcher.OBSERVERS.append(kernel)
    try:
        with _Mode(seen):
            yield seen
    finally:
        _counters.remove(seen)
        if not _counters:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
            launcher.OBSERVERS.remove(kernel)


@contextlib.contextmanager
def kernel(name: str):
    """Around a Triton kernel call (a launch observer of ``gpu.py``): one
    launch, and nothing inside it counted."""
    global _inside_kernel
    if _counters and not _inside_kernel:
        _counters[-1].launches.append("triton:" + name)
    _inside_kernel += 1
    try:
        yield
    finally:
        _inside_kernel -= 1
