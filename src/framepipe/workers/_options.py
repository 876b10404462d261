"""What every worker class takes about its processes, in one record.

``Worker``, ``Pool``, ``DataLoader`` and ``WorkerGroup`` all start processes the same way: a
start method, a name, an initializer, an environment, a working directory, where the output
goes and how long a stopping worker is given. :class:`ProcessOptions` holds those, checks them
once (each bad value refused with what to pass instead) and is what the supervision layer
(:mod:`framepipe.workers._process`) is handed; each class adds its own policy options beside it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import multiprocessing
import os
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ProcessOptions", "get_context"]


def get_context(start_method: str | None) -> Any:
    """The ``multiprocessing`` context for ``start_method`` (None: spawn), with a clear error
    for a method this platform does not have."""
    method = start_method or "spawn"
    try:
        return multiprocessing.get_context(method)
    except ValueError:
        raise ValueError(
            f"unknown start_method {method!r}; this platform has "
            f"{multiprocessing.get_all_start_methods()}"
        ) from None


@dataclasses.dataclass(frozen=True)
class ProcessOptions:
    """How a worker class starts and stops its processes.

    ``start_method`` is ``"spawn"``, ``"fork"`` or ``"forkserver"`` (None: spawn);
    ``initializer(*initargs)`` runs in each process before any work; ``env`` entries are set in
    its ``os.environ`` and ``cwd`` is its working directory; with ``log_dir`` its stderr and
    stdout go to ``log_dir/<name>/``, and ``tee`` copies them to the console too;
    ``kill_grace`` is how many seconds a stopping process is given before SIGKILL.
    """

    name: str
    start_method: str | None = "spawn"
    initializer: Callable[..., Any] | None = None
    initargs: tuple[Any, ...] = ()
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    log_dir: str | None = None
    tee: bool = False
    kill_grace: float = 1.0

    def __post_init__(self) -> None:
        if self.initializer is not None and not callable(self.initializer):
            raise TypeError(
                f"initializer must be callable, not {type(self.initializer).__name__}; pass a "
                f"function (its arguments go in initargs)"
            )
        if not isinstance(self.initargs, tuple):
            object.__setattr__(self, "initargs", tuple(self.initargs))
        if self.env is not None:
            bad = [
                k for k, v in self.env.items() if not isinstance(k, str) or not isinstance(v, str)
            ]
            if bad:
                raise TypeError(
                    f"env must map str to str; {bad[0]!r} does not (write the value as a "
                    f"string, e.g. env={{'OMP_NUM_THREADS': '1'}})"
                )
            object.__setattr__(self, "env", dict(self.env))
        for label in ("cwd", "log_dir"):
            value = getattr(self, label)
            if value is not None:
                object.__setattr__(self, label, os.fspath(value))
        if not isinstance(self.kill_grace, (int, float)) or not (
            self.kill_grace >= 0 and math.isfinite(self.kill_grace)
        ):
            raise ValueError(
                f"kill_grace must be a number of seconds >= 0, not {self.kill_grace!r}"
            )

    def context(self) -> Any:
        """The multiprocessing context of ``start_method`` (refused, with the methods this
        platform has, when it has no such method)."""
        return get_context(self.start_method)

    def sending(self, initializer: Any) -> ProcessOptions:
        """These options with the initializer in the form it travels to the child in (a
        function sent by value is not itself callable here: see ``_byvalue``)."""
        sent = copy.copy(self)
        object.__setattr__(sent, "initializer", initializer)
        return sent
