"""framepipe.joblib: joblib's Parallel and scikit-learn's n_jobs on framepipe workers."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time

import pytest

import framepipe

joblib = pytest.importorskip("joblib")

import framepipe.joblib as fj  # noqa: E402
from framepipe.workers import WorkerCrashed  # noqa: E402

WAIT = 60  # a hang guard only
HERE = os.path.dirname(os.path.abspath(__file__))
# the directory that holds the framepipe under test (installed, or src/ in a checkout)
SRC = os.path.dirname(os.path.dirname(os.path.abspath(framepipe.__file__)))


@pytest.fixture(autouse=True)
def _clean(no_leftover_processes):
    yield
    with fj._lock:
        shared, fj._shared = fj._shared, None
    if shared is not None:  # the workers kept for the next call: stopped with each test
        shared[1].shutdown(wait=True)


def _exit_at(i: int, at: int) -> int:
    if i == at:
        os._exit(7)
    return i


def test_importing_framepipe_does_not_import_joblib():
    code = "import sys, framepipe, framepipe.workers; print('joblib' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, PYTHONPATH=SRC),
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_parallel_runs_on_framepipe_workers():
    with joblib.parallel_config(backend="framepipe", n_jobs=2, start_method="fork"):
        assert joblib.Parallel()(joblib.delayed(abs)(-i) for i in range(1000)) == list(range(1000))
        pids = set(joblib.Parallel()(joblib.delayed(os.getpid)() for _ in range(50)))
        pool = fj._shared[1]
        assert pids <= set(pool.pids) and os.getpid() not in pids
        # lambdas and closures go by value
        k = 3
        assert joblib.Parallel()(joblib.delayed(lambda x: x * k)(i) for i in range(5)) == [
            0,
            3,
            6,
            9,
            12,
        ]
        gen = joblib.Parallel(return_as="generator")(joblib.delayed(abs)(-i) for i in range(20))
        assert list(gen) == list(range(20))
        unordered = joblib.Parallel(return_as="generator_unordered")(
            joblib.delayed(abs)(-i) for i in range(20)
        )
        assert sorted(unordered) == list(range(20))
        # the workers are kept from one call to the next
        assert fj._shared[1] is pool


@pytest.mark.parametrize(
    ("size", "took", "expected"),
    [
        (16, 0.001, 64),  # tiny tasks: four times the last size (joblib's own: twice)
        (1, 0.000001, 4),
        (16, 0.15, 42),  # near 0.2 s a batch: joblib's estimate of the ideal caps it
        (16, 0.5, 16),  # 0.2-2 s: kept
        (16, 3.0, 2),  # over 2 s: shrunk as joblib shrinks it
    ],
)
def test_batches_grow_to_joblib_size_in_fewer_steps(size, took, expected):
    backend = fj.FramepipeBackend()
    backend.parallel = joblib.Parallel()  # what configure() sets: its verbosity is read
    backend._effective_batch_size = size
    backend._smoothed_batch_duration = took
    assert backend.compute_batch_size() == expected
    assert backend._effective_batch_size == expected


def _tasks_run(pool) -> int:
    return sum(row["calls"] for row in pool.stats())


def test_a_call_of_tiny_tasks_sends_few_batches():
    """10,000 tiny calls: about 44 batches (joblib's doubling needs 64 or more: NOTE [ Batch
    growth ]), counted by the workers."""
    with joblib.parallel_config(backend="framepipe", n_jobs=2, start_method="fork"):
        assert joblib.Parallel()(joblib.delayed(abs)(-i) for i in range(5)) == list(range(5))
        pool = fj._shared[1]
        before = _tasks_run(pool)
        out = joblib.Parallel()(joblib.delayed(abs)(-i) for i in range(10_000))
        assert out == list(range(10_000))
        batches = _tasks_run(pool) - before
        assert 24 <= batches < 60, batches


def _nap(x: int) -> int:
    time.sleep(0.02)
    return x


def test_a_list_call_wakes_its_main_thread_once():
    """NOTE [ A list waits once ]: joblib's main thread sleeps until the call has settled, not
    at every batch (counted as the thread's voluntary context switches); a generator is read as
    its batches end, so its main thread waits at each."""
    import resource

    def switches() -> int:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw

    with joblib.parallel_config(backend="framepipe", n_jobs=2, start_method="fork"):
        assert joblib.Parallel()(joblib.delayed(abs)(-i) for i in range(4)) == list(range(4))
        seen = {}
        for return_as in ("list", "generator"):
            before = switches()
            out = joblib.Parallel(batch_size=1, return_as=return_as)(
                joblib.delayed(_nap)(i) for i in range(20)
            )
            assert list(out) == list(range(20))
            seen[return_as] = switches() - before
    # Waking at every batch would be 20 switches or more. A quiet machine shows 1; a loaded one
    # a few more, each a hand-off of the interpreter lock with the pool's manager thread (8 seen
    # in a CI run beside the rest of the suite).
    assert seen["list"] < 10, seen
    assert seen["generator"] >= 10, seen  # measured: 21-38


def _calls_then_fail(n: int):
    for i in range(n):
        yield joblib.delayed(abs)(-i)
    raise LookupError("the generator gave out")


@pytest.mark.parametrize("n", [1, 50])
def test_a_generator_that_raises_fails_a_list_call(n):
    """The caller's generator raises: as the call starts (1 item), or in the manager thread
    that runs joblib's dispatch as a batch ends, with no other batch running (50 items, one
    batch at a time): the main thread, asleep until the call settles (NOTE [ A list waits
    once ]), raises it."""
    with joblib.parallel_config(backend="framepipe", n_jobs=2, start_method="fork"):
        start = time.monotonic()
        with pytest.raises(LookupError, match="gave out"):
            joblib.Parallel(batch_size=1, pre_dispatch=1)(_calls_then_fail(n))
        assert time.monotonic() - start < WAIT
        assert joblib.Parallel()(joblib.delayed(abs)(-i) for i in range(5)) == list(range(5))


def test_a_crash_fails_the_call_with_worker_crashed():
    with joblib.parallel_config(backend="framepipe", n_jobs=2, start_method="fork"):
        with pytest.raises(WorkerCrashed) as info:
            joblib.Parallel(batch_size=1)(joblib.delayed(_exit_at)(i, 3) for i in range(8))
        assert info.value.exitcode == 7
        assert "BatchedCalls" in str(info.value)
        # the next call runs on new workers
        assert joblib.Parallel()(joblib.delayed(abs)(-i) for i in range(5)) == list(range(5))


def test_timeout_stops_the_call_and_its_workers():
    with joblib.parallel_config(backend="framepipe", n_jobs=2, start_method="fork"):
        start = time.monotonic()
        with pytest.raises(multiprocessing.TimeoutError):  # what joblib raises, as with loky
            joblib.Parallel(timeout=0.5, batch_size=1)(
                joblib.delayed(time.sleep)(s) for s in (0, 30, 0, 0)
            )
        assert time.monotonic() - start < 20
        assert joblib.Parallel()(joblib.delayed(abs)(-i) for i in range(5)) == list(range(5))


def _nap_or_fail(x: object) -> object:
    if isinstance(x, str):
        raise ValueError(x)
    time.sleep(float(x))  # type: ignore[arg-type]
    return x


@pytest.mark.parametrize("return_as", ["list", "generator"])
def test_a_failed_batch_stops_a_call_in_order_at_once(return_as):
    """Results in order are waited for in joblib's main thread: a batch that fails behind one
    still running raises at once, not once the batch before it ends."""
    with joblib.parallel_config(backend="framepipe", n_jobs=2, start_method="fork"):
        start = time.monotonic()
        with pytest.raises(ValueError, match="bad batch"):
            out = joblib.Parallel(batch_size=1, return_as=return_as)(
                joblib.delayed(_nap_or_fail)(x) for x in (30, "bad batch", 0, 0)
            )
            list(out)
        assert time.monotonic() - start < 20  # not after the 30 s batch ahead of it
        assert joblib.Parallel()(joblib.delayed(abs)(-i) for i in range(5)) == list(range(5))


def test_n_jobs_one_runs_here():
    with joblib.parallel_config(backend="framepipe", n_jobs=1):
        assert joblib.Parallel()(joblib.delayed(os.getpid)() for _ in range(3)) == [os.getpid()] * 3


def test_scikit_learn_cross_val_score():
    pytest.importorskip("sklearn")
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import cross_val_score

    X, y = load_iris(return_X_y=True)
    model = LogisticRegression(max_iter=500)
    with joblib.parallel_config(backend="framepipe"):
        scores = cross_val_score(model, X, y, cv=4, n_jobs=2)
        pool = fj._shared[1]
        assert len(pool.pids) == 2  # ran on framepipe workers
    assert scores.shape == (4,) and scores.mean() > 0.9
    assert list(scores) == list(cross_val_score(model, X, y, cv=4, n_jobs=1))


# joblib's own tests that take a backend name, run against "framepipe" (see
# _joblib_suite_plugin). Left out, with why:
EXCLUDED = {
    # a nested Parallel(backend="framepipe") runs in a loky, multiprocessing or framepipe
    # worker, or a new interpreter, that never imported framepipe.joblib: the name is unknown
    # there (the backend is registered by importing framepipe.joblib)
    "nested_loop": "the name is not registered in a process that did not import it",
    "interactively_defined_functions": "runs a new interpreter that does not import it",
    "unpicklable_functions_in_args": "runs a new interpreter that does not import it",
    # joblib's memory-mapping of large arrays belongs to its loky/multiprocessing backends;
    # framepipe sends large arrays through shared memory of its own
    "memmap": "no np.memmap arguments: framepipe has its own shared memory",
    # a task that raises KeyboardInterrupt: framepipe reports it as a WorkerError whose cause
    # it is, never as a Ctrl-C in the caller
    "error_capture": "KeyboardInterrupt in a task comes as WorkerError",
}


def test_joblib_own_backend_tests(tmp_path):
    pytest.importorskip("joblib.test.test_parallel")
    report = tmp_path / "report.xml"
    selection = "framepipe and not (" + " or ".join(EXCLUDED) + ")"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([SRC, HERE, os.environ.get("PYTHONPATH", "")]),
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "_joblib_suite_plugin",
            "--pyargs",
            "joblib.test.test_parallel",
            "-k",
            selection,
            "-q",
            "-W",
            "ignore",
            f"--junitxml={report}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]
    import xml.etree.ElementTree as ET

    suite = ET.parse(report).getroot().find("testsuite")
    assert suite is not None
    ran = int(suite.get("tests", 0)) - int(suite.get("skipped", 0))
    assert ran >= 100 and int(suite.get("failures", 0)) == 0 and int(suite.get("errors", 0)) == 0
