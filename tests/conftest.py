"""One suite, both implementations: the ``impl`` fixture yields the core module, ids c / py."""

from __future__ import annotations

import os

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


def pytest_addoption(parser):
    parser.addoption(
        "--fuzz-minutes",
        type=float,
        default=0,
        help="run each frame-fuzzing property for about this many minutes (default: the "
        "quick profile of a few hundred cases per core)",
    )
