"""What every change to fairseq is: a :class:`Patch`, installed once."""

import functools
from typing import Callable, NamedTuple


class Patch(NamedTuple):
    name: str
    reason: str
    install: Callable[[], None]
    test: str  # tests/<file>::<function>


def installs_once(install: Callable[[], None]) -> Callable[[], None]:
    """``install`` runs on its first call only: fairseq calls the
    architectures and ``build_model`` many times, and a patch installed twice
    would wrap fairseq's function in itself. ``install.installed`` says
    whether it has run."""

    @functools.wraps(install)
    def once():
        if not once.installed:
            install()
            once.installed = True

    once.installed = False
    return once
