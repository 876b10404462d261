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


@pytest.fixture
def fd_count():
    """The number of open fds of this process, as a function."""

    def count() -> int:
        return len(os.listdir("/proc/self/fd"))

    return count
