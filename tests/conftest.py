"""One suite, both implementations: the ``impl`` fixture yields the core module, ids c / py."""

from __future__ import annotations

import multiprocessing
import os
import time

import psutil
import pytest

from framepipe import _impl

REQUIRE = bool(os.environ.get("FRAMEPIPE_REQUIRE_EXTENSIONS"))


@pytest.fixture(scope="session", params=["c", "python"], ids=["c", "py"])
def impl(request):
    try:
        return _impl.load(request.param)
    except ImportError as exc:
        if REQUIRE:
            pytest.fail(
                f"FRAMEPIPE_REQUIRE_EXTENSIONS=1 but the {request.param} core is missing: {exc}"
            )
        pytest.skip(f"the {request.param} core is not built: {exc}")


@pytest.fixture(params=[False, True], ids=["oneway", "duplex"])
def pair(request, impl):
    """``(reader, writer)`` of ``impl.pipe(duplex)``, one-way and duplex; closed after the test."""
    r, w = impl.pipe(request.param)
    yield r, w
    r.close()
    w.close()


def _is_background_fd(fd: str) -> bool:
    """pidfds and epoll fds belong to liveness watches and to the process watcher thread,
    which may close them at any moment (when a watched writer of an earlier test dies)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("anon_inode:")
    except OSError:
        return True  # closed while we looked


@pytest.fixture
def fd_count():
    """The number of open fds of this process (pipes, sockets, files), as a function."""

    def count() -> int:
        return sum(1 for fd in os.listdir("/proc/self/fd") if not _is_background_fd(fd))

    return count


@pytest.fixture
def engine(impl, monkeypatch):
    """Run the layers above the engine (connection.Pipe, the workers) on ``impl``: channels
    made in this process use it, and a worker process rebuilds them with the same engine."""
    monkeypatch.setattr(_impl, "core", impl)
    return impl


def _own_children():
    """This process's descendants, less multiprocessing's own helpers (the forkserver and the
    resource tracker, which outlive a test by design) and zombies."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "multiprocessing.forkserver" in cmd or "multiprocessing.resource_tracker" in cmd:
            continue
        out.append(p)
    return out


@pytest.fixture
def no_leftover_processes():
    """Fails the test if it leaves a process of its own behind (and kills what it left)."""
    before = {p.pid for p in _own_children()}
    yield
    deadline = time.monotonic() + 10
    while True:
        left = [p for p in _own_children() if p.pid not in before]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    assert not left, f"processes left behind: {[p.pid for p in left]}"


@pytest.fixture
def no_leftover_loader_workers():
    """Fails the test if a DataLoader worker outlives it (and kills what it left)."""
    yield
    deadline = time.monotonic() + 5.0
    leftovers = []
    while True:
        leftovers = [
            p for p in multiprocessing.active_children() if p.name.startswith("DataLoader-worker")
        ]
        if not leftovers or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    for p in leftovers:
        p.kill()
        p.join(5)
    assert not leftovers, f"workers left running: {[p.pid for p in leftovers]}"


def pytest_addoption(parser):
    parser.addoption(
        "--fuzz-minutes",
        type=float,
        default=0,
        help="run each frame-fuzzing property for about this many minutes (default: the "
        "quick profile of a few hundred cases per core)",
    )
