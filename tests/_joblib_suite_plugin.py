"""A pytest plugin that runs joblib's own backend tests against the "framepipe" backend.

``pytest --pyargs joblib.test.test_parallel -p _joblib_suite_plugin -k framepipe``: the backend
is registered before joblib's test module is imported (so its lists built from joblib's
registry include it), and every test parametrized by ``backend`` over joblib's process backends
gets "framepipe" as one more value.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    import framepipe.joblib  # noqa: F401 - registers the backend

    config.addinivalue_line("markers", "thread_unsafe: joblib's own marker")


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    markers = metafunc.definition.own_markers
    for i, mark in enumerate(markers):
        if mark.name != "parametrize" or not mark.args or mark.args[0] != "backend":
            continue
        values = list(mark.args[1])
        if "loky" in values and "framepipe" not in values:
            markers[i] = pytest.mark.parametrize(
                "backend", [*values, "framepipe"], **mark.kwargs
            ).mark
