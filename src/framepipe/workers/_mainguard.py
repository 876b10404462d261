"""Refusing to start workers while a spawned worker imports the main module.

Under ``spawn`` (and ``forkserver``) a worker process imports the parent's main module before
it runs anything. A main module that starts workers at its top level, outside
``if __name__ == "__main__":``, would start them again in each worker, without end;
``multiprocessing`` refuses with a long ``RuntimeError`` deep in the worker's stderr. Every
worker class calls :func:`refuse_during_main_import` before it starts anything: in that case
the worker exits at once with one line on its stderr, which the parent recognises
(``errors.MAIN_GUARD_MARK``) and reports as :class:`~framepipe.workers.MainGuardError`.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys

from .errors import MAIN_GUARD_EXIT, MAIN_GUARD_MARK

__all__ = ["refuse_during_main_import"]

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _user_frame() -> str | None:
    """``"file, line N"`` of the nearest caller outside framepipe."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not os.path.abspath(path).startswith(_PKG):
            return f"{os.path.basename(path)}, line {frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return None


def refuse_during_main_import(what: str) -> None:
    """Exit this process (a worker still importing its parent's main module) with one line
    on its stderr that says why, and the exit code the parent recognises; do nothing anywhere
    else."""
    if not getattr(multiprocessing.current_process(), "_inheriting", False):
        return
    where = _user_frame()
    at = f" (at {where})" if where else ""
    with contextlib.suppress(Exception):
        sys.stderr.write(
            f"{MAIN_GUARD_MARK}: {what} started{at}; put that code under "
            '`if __name__ == "__main__":` or use start_method="fork"\n'
        )
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    # os._exit, not SystemExit: a forkserver's child would turn that into exit code 1
    os._exit(MAIN_GUARD_EXIT)
