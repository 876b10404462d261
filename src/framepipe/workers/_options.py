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
import multiprocessing
import os
from collections.abc import Callable, Mapping
from typing import Any

from .._args import check_seconds, check_type

__all__ = ["ProcessOptions", "get_context"]


def get_context(start_method: str | None) -> Any:
    """The ``multiprocessing`` context for ``start_method`` (None: spawn), with a clear error
    for a method this platform does not have."""
    method = "spawn" if start_method is None else check_type("start_method", start_method, str)
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
        check_type("name", self.name, str)
        get_context(self.start_method)  # an unknown method is refused now, not at the start
        check_type("tee", self.tee, bool)
        if self.initializer is not None and not callable(self.initializer):
            raise TypeError(
                f"initializer must be callable, not {type(self.initializer).__name__}; pass a "
                f"function (its arguments go in initargs)"
            )
        if not isinstance(self.initargs, tuple):
            try:
                if isinstance(self.initargs, (str, bytes)):
                    raise TypeError  # iterable, but a string is one argument, not many
                object.__setattr__(self, "initargs", tuple(self.initargs))
            except TypeError:
                raise TypeError(
                    f"initargs must be a tuple of the initializer's arguments, not "
                    f"{type(self.initargs).__name__} ({self.initargs!r:.60}); for one "
                    "argument write initargs=(value,)"
                ) from None
        check_type("env", self.env, Mapping, none_ok=True)
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
        if self.cwd is not None and not os.path.isdir(self.cwd):
            kind = NotADirectoryError if os.path.exists(self.cwd) else FileNotFoundError
            raise kind(
                f"cwd {self.cwd!r} is not a directory: the worker processes start in it; pass "
                "an existing directory, or None for this process's"
            )
        check_seconds("kill_grace", self.kill_grace, none_ok=False, zero_ok=True, finite=True)

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
