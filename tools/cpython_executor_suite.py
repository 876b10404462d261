#!/usr/bin/env python3
"""Run CPython's own ``ProcessPoolExecutor`` tests against ``framepipe.workers.Pool``.

The tests are CPython 3.11's ``Lib/test/test_concurrent_futures.py``, imported at run time
from where the interpreter's distribution installs them (Debian:
``apt-get install libpython3.11-testsuite``); they are never copied here. Only the process-pool
test classes run, under the fork and spawn start methods, with one change: the executor they
build is a ``Pool`` (``ProcessPoolExecutor(max_workers, mp_context, initializer, initargs,
max_tasks_per_child)`` mapped onto ``Pool``'s arguments), in this process and in the child
interpreters that some tests start. The tests in ``EXCLUDED`` do not run, each for the reason
given there: they read the stdlib executor's private attributes or its exact wording.

    python tools/cpython_executor_suite.py            # framepipe's Pool
    python tools/cpython_executor_suite.py --stdlib   # the stdlib's executor, for comparison
    python tools/cpython_executor_suite.py -k Deadlock -v

Exits 0 when every test that runs passes, 1 otherwise, and 0 with a message when the test
file is not installed (``--require`` makes that an error).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import multiprocessing
import os
import signal
import sys
import threading
import types
import unittest
import weakref
from typing import Any, cast

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")  # where framepipe is not installed

# Class-name prefixes of the test classes that run (the process-pool ones, fork and spawn).
PREFIXES = ("ProcessPoolFork", "ProcessPoolSpawn")
FORKSERVER = "ProcessPoolForkserver"

# Tests that cannot pass on another executor whatever it does, by method name (under both
# start methods). One line of reason each.
EXCLUDED = {
    # They read the stdlib executor's private attributes.
    "test_processes_terminate": "reads executor._processes",
    "test_context_manager_shutdown": "reads executor._processes",
    "test_del_shutdown": "reads _processes, _call_queue, _executor_manager_thread",
    "test_shutdown_no_wait": "reads _processes, _call_queue, _executor_manager_thread",
    "test_killed_child": "reads executor._processes to kill a worker",
    "test_saturation": "reads executor._processes (spawned on demand)",
    "test_idle_process_reuse_one": "reads executor._processes (spawned on demand)",
    "test_idle_process_reuse_multiple": "reads executor._processes (spawned on demand)",
    "test_max_tasks_per_child": "reads executor._processes; fork refusal is a stdlib limit",
    "test_max_tasks_per_child_defaults_to_spawn_context": "reads executor._mp_context",
    "test_shutdown_deadlock_pickle": "reads executor._executor_manager_thread",
    "test_initializer": "FailingInitializer: polls executor._broken",
    # They check the stdlib's exact wording or its private types.
    "test_max_workers_negative": "the wording 'max_workers must be greater than 0'",
    "test_traceback": "the cause is the stdlib's private _RemoteTraceback",
    "test_submit_after_interpreter_shutdown": "the wording 'cannot schedule new futures'",
}

# Tests that ExcludedInitializer names: test_initializer is excluded only in the failing
# initializer's classes (the working initializer's test runs).
_ONLY_IN = {"test_initializer": "FailingInitializer"}


def find_test_file(path: str | None = None) -> str | None:
    """The installed ``test_concurrent_futures.py`` of this interpreter's version, or None."""
    if path:
        return path if os.path.isfile(path) else None
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    spec = importlib.util.find_spec("test.test_concurrent_futures")
    candidates = [spec.origin] if spec is not None and spec.origin else []
    candidates.append(os.path.join("/usr/lib", version, "test", "test_concurrent_futures.py"))
    for candidate in candidates:
        if candidate and os.path.isfile(candidate):
            return candidate
    return None


_ENV = "FRAMEPIPE_CPYTHON_SUITE_FILE"


class _Finder:
    """Imports ``test.test_concurrent_futures`` from the file found, in this process and in
    every process started from it (spawned workers unpickle the tests' functions by that
    name), where the interpreter's own ``test`` package lacks it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "test.test_concurrent_futures":
            return None
        return importlib.util.spec_from_file_location(name, self.path)


def _register(path: str) -> None:
    os.environ[_ENV] = path
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(path))


def _foreign() -> bool:
    """Whether the test file is not this interpreter's own (the workers then need the
    finder, which importing this module installs: see :func:`_boot`)."""
    import test

    own = os.path.join(os.path.dirname(test.__file__), "test_concurrent_futures.py")
    return os.environ.get(_ENV) not in (None, own)


def _boot(initializer: Any, initargs: tuple[Any, ...]) -> None:
    """A worker's first call where the test file is not the interpreter's own: importing
    this module (to unpickle this function) has installed the finder; then the tests' own
    initializer."""
    if initializer is not None:
        initializer(*initargs)


if os.environ.get(_ENV):
    _register(os.environ[_ENV])


def _executor_class() -> type:
    """A ``Pool`` that takes ``ProcessPoolExecutor``'s constructor arguments."""
    from framepipe.workers import Pool

    class ProcessPoolExecutor(Pool):
        made: weakref.WeakSet[Pool] = weakref.WeakSet()

        def __init__(
            self,
            max_workers: int | None = None,
            mp_context: Any = None,
            initializer: Any = None,
            initargs: tuple[Any, ...] = (),
            *,
            max_tasks_per_child: int | None = None,
        ) -> None:
            method = (
                mp_context.get_start_method()
                if mp_context is not None
                else multiprocessing.get_start_method(allow_none=True) or "spawn"
            )
            if _foreign():
                initializer, initargs = _boot, (initializer, initargs)
            super().__init__(
                max_workers,
                start_method=method,
                initializer=initializer,
                initargs=initargs,
                max_tasks_per_worker=max_tasks_per_child,
            )
            self.made.add(self)

    ProcessPoolExecutor.__module__ = "concurrent.futures"
    return ProcessPoolExecutor


def install() -> None:
    """Make ``concurrent.futures.ProcessPoolExecutor`` the ``Pool`` adapter in this process
    (run first in the child interpreters the tests start)."""
    setattr(concurrent.futures, "ProcessPoolExecutor", _executor_class())  # noqa: B010


_CHILD_PRELUDE = (
    "import sys; sys.path[:0] = [{src!r}, {tools!r}]\n"
    "import cpython_executor_suite\n"
    "if {swap}: cpython_executor_suite.install()\n"
)


def load(path: str, stdlib: bool = False) -> types.ModuleType:
    """Import the test module from ``path`` (as ``test.test_concurrent_futures``, the name its
    child scripts import it by), the process-pool mixins building framepipe's Pool unless
    ``stdlib``."""
    _register(path)
    mod = importlib.import_module("test.test_concurrent_futures")
    # The child interpreters of the interpreter-shutdown tests import the same file, and
    # make the same swap first.
    original = mod.assert_python_ok
    import framepipe  # the children import the very same one (installed, or this checkout's)

    root = os.path.dirname(os.path.dirname(os.path.abspath(framepipe.__file__)))
    prelude = _CHILD_PRELUDE.format(src=root, tools=HERE, swap=not stdlib)

    def assert_python_ok(*args: str, **env: Any) -> Any:
        args = tuple(
            prelude + a if i > 0 and args[i - 1] == "-c" else a for i, a in enumerate(args)
        )
        return original(*args, **env)

    mod.assert_python_ok = assert_python_ok  # type: ignore[attr-defined]
    if stdlib:
        return mod
    executor = _executor_class()
    # ``futures.ProcessPoolExecutor`` as the tests spell it, and the mixins' executor_type.
    proxy = types.ModuleType("concurrent.futures")
    proxy.__dict__.update(concurrent.futures.__dict__)
    proxy.ProcessPoolExecutor = executor  # type: ignore[attr-defined]
    mod.futures = proxy  # type: ignore[attr-defined]
    for mixin in ("ProcessPoolForkMixin", "ProcessPoolSpawnMixin", "ProcessPoolForkserverMixin"):
        getattr(mod, mixin).executor_type = executor
    return mod


def build_suite(mod: types.ModuleType, stdlib: bool, keyword: str | None) -> unittest.TestSuite:
    suite = unittest.TestSuite()
    loader = unittest.TestLoader()
    for name in sorted(vars(mod)):
        cls = getattr(mod, name)
        if not (isinstance(cls, type) and issubclass(cls, unittest.TestCase)):
            continue
        if not name.startswith(PREFIXES) or name.startswith(FORKSERVER):
            continue
        for test in cast("list[unittest.TestCase]", list(loader.loadTestsFromTestCase(cls))):
            method = test.id().rsplit(".", 1)[-1]
            if keyword and keyword not in test.id():
                continue
            reason = EXCLUDED.get(method)
            if reason and method in _ONLY_IN and _ONLY_IN[method] not in name:
                reason = None
            if reason and not stdlib:
                setattr(test, method, unittest.skip(f"excluded: {reason}")(getattr(test, method)))
            suite.addTest(test)
    return suite


class _TimedResult(unittest.TextTestResult):
    """A test still running after ``limit`` seconds fails (a signal sent to the main thread
    raises in it, once a second until it ends), and the run goes on: a hang is a failure,
    never a stuck run. The pools a test left running are terminated after it."""

    limit = 60.0
    executor: Any = None

    def startTest(self, test: unittest.TestCase) -> None:
        done = self._done = threading.Event()
        main = threading.main_thread().ident
        assert main is not None

        def expired(signum: int, frame: Any) -> None:
            raise TimeoutError(f"{test.id()} still running after {self.limit:g} s: a hang")

        def watch() -> None:
            if not done.wait(self.limit):
                while not done.wait(1.0):
                    signal.pthread_kill(main, signal.SIGALRM)

        signal.signal(signal.SIGALRM, expired)
        threading.Thread(target=watch, daemon=True, name="suite-watchdog").start()
        super().startTest(test)

    def stopTest(self, test: unittest.TestCase) -> None:
        self._done.set()
        if self.executor is not None:
            for pool in list(self.executor.made):
                pool.terminate()
            self.executor.made.clear()
        super().stopTest(test)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", help="the test_concurrent_futures.py to run")
    parser.add_argument("--stdlib", action="store_true", help="run the stdlib's executor")
    parser.add_argument("--require", action="store_true", help="fail if the file is absent")
    parser.add_argument("-k", dest="keyword", help="only tests whose id contains this")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a test may run")
    parser.add_argument("-v", dest="verbosity", action="store_const", const=2, default=1)
    args = parser.parse_args(argv)
    if sys.version_info[:2] != (3, 11):
        print(f"skipped: the adapted suite is CPython 3.11's; this is {sys.version.split()[0]}")
        return 0
    path = find_test_file(args.file)
    if path is None:
        print(
            "skipped: test_concurrent_futures.py is not installed "
            "(Debian: apt-get install libpython3.11-testsuite)"
        )
        return 1 if args.require else 0
    if importlib.util.find_spec("framepipe") is None:
        sys.path.insert(0, SRC)
    mod = load(path, stdlib=args.stdlib)
    if not args.stdlib:
        _TimedResult.executor = mod.ProcessPoolForkMixin.executor_type
    suite = build_suite(mod, args.stdlib, args.keyword)
    _TimedResult.limit = args.timeout
    runner = unittest.TextTestRunner(
        verbosity=args.verbosity,
        resultclass=_TimedResult,  # type: ignore[arg-type]
    )
    result = runner.run(suite)
    ran = result.testsRun - len(result.skipped)
    failed = len(result.failures) + len(result.errors)
    print(
        f"{'stdlib' if args.stdlib else 'framepipe'}: {ran - failed} passed, {failed} failed, "
        f"{len(result.skipped)} skipped of {result.testsRun} ({path})"
    )
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
