"""PN's warmup clock: which plan the coming training forward takes, known on the host.

The step counter itself lives on the device (``num_steps``, advanced by the
statistics kernel only for a batch with real tokens), so no step waits to
read it. The host keeps a bool, ``warm``, that changes once, when the warmup
ends: torch.compile guards on it, which gives one graph per phase and no
recompile within one. The bool is advanced where the step is committed, in
the ``finish_stats`` op's own code (``kernels/ops.py``), which runs at run time
even in a compiled graph. While the host's count of forwards says the warmup
may still be on, nothing is read; after that the device counter is read once
(one wait, at the end of the warmup), and again only if batches of padding
held it back.
"""

import weakref

#: clocks by key, for the op that advances them (a compiled graph passes the key, an int)
CLOCKS = weakref.WeakValueDictionary()


def advance(key: int, steps) -> None:
    """Advance clock ``key`` (-1: none) after a training forward committed its
    step (``steps``: the device counter): the finish_stats op's, or the CPU's
    autograd node's caller (``kernels/functions.py``)."""
    if key >= 0:
        CLOCKS[key].advance(steps)


class Clock:
    def __init__(self, warmup: int):
        self.warmup = warmup
        self._register()
        self.set(0)

    def _register(self):
        self.key = id(self)
        CLOCKS[self.key] = self

    def __setstate__(self, state):  # a copy (deepcopy, pickle) is a clock of its own
        self.__dict__.update(state)
        self._register()

    def set(self, steps: int):
        """The device counter's value, as a load gives it."""
        self.forwards, self.warm = steps, steps < self.warmup

    def advance(self, steps):
        """After a training forward committed its step (``steps``: the device counter)."""
        self.forwards += 1
        if self.warm and self.forwards >= self.warmup:
            self.set(int(steps))
