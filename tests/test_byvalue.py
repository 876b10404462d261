"""Functions by value (framepipe.workers._byvalue): lambdas, closures, nested functions and
functions of ``__main__`` that a worker cannot import are sent with cloudpickle, once per
worker; importable functions still go by reference. Real processes, every start method."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

import framepipe

pytest.importorskip("cloudpickle")

import _byvalue_children as kids  # noqa: E402

from framepipe.workers import DataLoader, Pool, Worker, WorkerError  # noqa: E402
from framepipe.workers.group import WorkerGroup  # noqa: E402

WAIT = 60  # a hang guard only
METHODS = ["fork", "spawn", "forkserver"]
# the directory that holds the framepipe under test (installed, or src/ in a checkout)
SRC = os.path.dirname(os.path.dirname(os.path.abspath(framepipe.__file__)))


pytestmark = pytest.mark.usefixtures("no_leftover_processes")


@pytest.mark.parametrize("method", METHODS)
def test_lambdas_closures_and_nested_functions_run_in_a_pool(method):
    k = 7

    def nested(x):
        return x * k

    with Pool(2, start_method=method) as pool:
        assert list(pool.map(lambda x: x * 2, range(50))) == [x * 2 for x in range(50)]
        assert list(pool.map(nested, range(20), chunksize=3)) == [x * 7 for x in range(20)]
        assert pool.submit(nested, 3).result(WAIT) == 21
        assert pool.submit(kids.make_adder(5), 1).result(WAIT) == 6
        # as an argument, and as a result
        assert pool.submit(kids.call, lambda a, b: a - b, 5, 3).result(WAIT) == 2
        assert pool.submit(kids.make_adder, 10).result(WAIT)(1) == 11
        # in the items of a map
        adders = [kids.make_adder(i) for i in range(5)]
        assert list(pool.map(kids.call, adders, range(5))) == [2 * i for i in range(5)]
        # what cannot be pickled even by value still fails only its task, saying why
        with pytest.raises(TypeError, match="by value"):
            pool.submit(kids.call, lambda: 1, threading.Lock()).result(WAIT)
        assert pool.submit(abs, -4).result(WAIT) == 4
        assert pool.broken is None and pool.crashes == []


@pytest.mark.parametrize("method", METHODS)
def test_a_worker_calls_and_streams_lambdas(method):
    with Worker(start_method=method) as w:
        assert w.call(lambda: 41 + 1) == 42
        assert list(w.stream(lambda n: (i * i for i in range(n)), 4)) == [0, 1, 4, 9]


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_function_by_value_is_pickled_once_and_sent_once_per_worker(method, tmp_path):
    path = str(tmp_path / "loads")
    kids.REDUCED = 0
    fn = kids.make_closure(kids.Counted(path, 1))
    with Pool(2, start_method=method) as pool:
        futures = [pool.submit(fn, i) for i in range(300)]
        assert [f.result(WAIT) for f in futures] == [i + 1 for i in range(300)]
        assert list(pool.map(fn, range(2000))) == [i + 1 for i in range(2000)]
        assert list(pool.map(fn, range(100), chunksize=7)) == [i + 1 for i in range(100)]
        assert pool._core.byvalue.pickled == 1
        pids = set(pool.pids)
    assert kids.REDUCED == 1  # pickled once in this process
    with open(path) as f:
        loaded_in = [int(line) for line in f]
    # loaded once in each worker that ran it, never twice in one
    assert 1 <= len(loaded_in) <= 2 and len(set(loaded_in)) == len(loaded_in)
    assert set(loaded_in) <= pids


def test_a_lambda_written_again_is_the_same_definition():
    with Pool(1, start_method="fork") as pool:
        for i in range(20):
            assert pool.submit(lambda x: x + 1, i).result(WAIT) == i + 1
        assert len(pool._core.byvalue.defs) == 1


def test_importable_functions_go_by_reference():
    with Pool(2, start_method="spawn") as pool:
        assert list(pool.map(kids.pid_of_worker, range(10)))
        assert pool.submit(kids.call, abs, -1).result(WAIT) == 1
        assert pool._core.byvalue is None  # nothing went by value


def _run(code: str, *extra: str, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, *extra, *([] if extra else ["-c", code])],
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT,
        cwd=cwd,
    )


MAIN_GUARDED = """
from framepipe.workers import Pool

def top(x):  # module level: a spawned worker imports it, it goes by reference
    return SCALE * x

SCALE = 1

def set_scale(s):
    global SCALE
    SCALE = s

if __name__ == "__main__":
    def guarded(x):  # a spawned worker never defines this one
        return x + 100

    with Pool(2, start_method="{method}", initializer=set_scale, initargs=(3,)) as pool:
        print(list(pool.map(top, range(4))), pool._core.byvalue is None)
        print(list(pool.map(guarded, range(4))), pool.submit(guarded, 1).result(60))
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_main_functions_of_a_spawned_program(method, tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(MAIN_GUARDED.replace("{method}", method))
    out = _run("", str(script), cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    # the initializer's global is seen by the module-level function (by reference)
    assert out.stdout.splitlines() == ["[0, 3, 6, 9] True", "[100, 101, 102, 103] 101"]


def test_main_functions_without_a_file():
    code = textwrap.dedent(
        """
        from framepipe.workers import Pool
        def f(x):
            return -x
        if __name__ == "__main__":
            with Pool(2, start_method="spawn") as pool:
                print(list(pool.map(f, range(3))), pool.submit(f, 5).result(60))
        """
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[0,", "-1,", "-2]", "-5"]


def test_without_cloudpickle_the_error_names_the_extra():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["cloudpickle"] = None  # as if it were not installed
        from framepipe.workers import Pool, TaskPicklingError
        if __name__ == "__main__":
            with Pool(1, start_method="fork") as pool:
                print(pool.submit(abs, -2).result(60))
                try:
                    pool.submit(lambda: 1).result(60)
                except TaskPicklingError as exc:
                    print("submit:", exc)
                # every form of map, a few items or many (chunked on its own), fails as submit
                for n, kw in [(1, {}), (5000, {}), (9, {"chunksize": 3}), (9, {"buffersize": 4})]:
                    try:
                        list(pool.map(lambda x: x, range(n), **kw))
                    except TaskPicklingError as exc:
                        print("map:", exc)
                try:
                    list(pool.imap(lambda x: x, range(3)))
                except TaskPicklingError as exc:
                    print("imap:", exc)
        """
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "2"
    assert [line.split(":")[0] for line in lines[1:]] == ["submit", *["map"] * 4, "imap"], lines
    for line in lines[1:]:
        what = line.split(": ", 1)[1]
        assert what.startswith("cannot send the function <lambda> to a worker process"), line
        assert "framepipe[cloudpickle]" in line, line


def test_a_definition_the_worker_cannot_load_fails_its_tasks_not_the_worker():
    # a function whose pickle by value needs a module that only this process has
    import types

    mod = types.ModuleType("only_in_the_parent")
    sys.modules["only_in_the_parent"] = mod
    try:
        exec("class Thing:\n    pass\n", mod.__dict__)  # noqa: S102
        thing = mod.Thing()
        fn = lambda: thing  # noqa: E731
        with Pool(1, start_method="spawn") as pool:
            pid = pool.submit(os.getpid).result(WAIT)
            with pytest.raises(WorkerError, match="could not be"):
                pool.submit(fn).result(WAIT)
            assert pool.submit(os.getpid).result(WAIT) == pid  # the same worker goes on
    finally:
        del sys.modules["only_in_the_parent"]


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_dataset_and_collate_fn_by_value(method):
    scale = 3
    loader = DataLoader(
        kids.Mapped(8, lambda i: i * scale),
        batch_size=2,
        num_workers=2,
        collate_fn=lambda batch: sum(batch),
        start_method=method,
        timeout=WAIT,
    )
    with loader:
        assert list(loader) == [3 * (2 * b + 2 * b + 1) for b in range(4)]


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_worker_group_entry_point_by_value(method):
    base = 10
    with WorkerGroup(lambda r: base + r, 2, args={0: (0,), 1: (1,)}, start_method=method) as g:
        result = g.wait(WAIT)
    assert result.return_values == {0: 10, 1: 11}
