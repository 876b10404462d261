"""What a newcomer's mistakes and a worker's failures say: each error's first line names what
happened and what to do, reports put the user's frame first and say nothing twice, and the
demo's and the bench's output fits the terminal (100 columns when unknown).

Programs a user would write run for real in a fresh interpreter (a file, ``python -``,
``python -c``); the first line of each message is asserted, not the whole text."""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import pickle
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from _helpers import child_env, run_python
from _message_tasks import (
    abort_now,
    exit_after_saying,
    exit_with_pipe_end,
    hang,
    identity,
    parse,
    talk_then_die,
    write_in_two_parts,
)

import framepipe
from framepipe import connection
from framepipe._width import output_width, wrap_line
from framepipe.bench import load as bench_load
from framepipe.bench import table
from framepipe.workers import (
    DataLoader,
    MainGuardError,
    Pool,
    PoolBroken,
    TaskTimeout,
    Worker,
    WorkerCrashed,
    WorkerStartError,
)
from framepipe.workers.errors import tidy_dump

WAIT = 60  # a hang guard only
RUN = 120  # a program's hang guard
TRACEBACK = "Traceback (most recent call last):"


pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def run_program(
    code: str, how: str, tmp_path: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as a user would: ``file`` (python prog.py), ``stdin`` (python - < prog)
    or ``c`` (python -c CODE); in ``tmp_path``, framepipe from this checkout."""
    code = textwrap.dedent(code)
    full = child_env(**(env or {}))
    if how == "file":
        path = tmp_path / "prog.py"
        path.write_text(code)
        argv, stdin = [str(path)], None
    elif how == "stdin":
        argv, stdin = ["-"], code
    else:
        argv, stdin = ["-c", code], None
    return run_python(*argv, input=stdin, timeout=RUN, cwd=tmp_path, env=full)


def exception_line(stderr: str, name: str) -> str:
    """The first line of the uncaught exception ``name`` in a printed traceback."""
    for line in stderr.splitlines():
        if re.match(rf"^(\w+\.)*{name}: ", line):
            return line
    raise AssertionError(f"no {name} in:\n{stderr}")


# -- a main module that starts workers when imported ----------------------------------------

UNGUARDED = """
    from framepipe.workers import Pool

    def square(x):
        return x * x

    with Pool(2, start_method="METHOD") as pool:
        print(pool.submit(square, 3).result())
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_workers_started_at_import_get_their_own_error_naming_the_fix(tmp_path, method):
    out = run_program(UNGUARDED.replace("METHOD", method), "file", tmp_path)
    assert out.returncode == 1
    first = exception_line(out.stderr, "MainGuardError")
    assert first.startswith("framepipe.workers.errors.MainGuardError: worker 'pool-")
    assert "died while starting: the main module starts workers when it is imported" in first
    assert '`if __name__ == "__main__":`' in first and 'start_method="fork"' in first
    assert "prog.py" in first
    # the worker's own words, once per worker, with the line that started workers
    said = [line for line in out.stderr.splitlines() if line.startswith("framepipe: workers")]
    assert said and all("(at prog.py, line 7)" in line for line in said)
    # the pool's error leads with the same words; "while idle" is gone
    assert "pool is broken: worker 'pool-" in exception_line(out.stderr, "PoolBroken")
    assert "while idle" not in out.stderr
    # short: nothing from multiprocessing's bootstrap, no report above 12 lines
    assert "bootstrapping phase" not in out.stderr
    assert len(out.stderr.split(TRACEBACK)[0].splitlines()) <= 12, out.stderr


# Each way of starting workers at import (no main guard): the program's code, the error it
# ends with, and what the error's first line says.
STARTED_AT_IMPORT = {
    "worker": (
        """
        from framepipe.workers import Worker

        with Worker() as w:
            print(w.call(abs, -2))
        """,
        "WorkerCrashed",
        "exited with code 121 while starting: the main module starts workers",
    ),
    "dataloader": (
        """
        from framepipe.workers import DataLoader

        class Items:
            def __len__(self):
                return 8

            def __getitem__(self, i):
                return i

        for batch in DataLoader(Items(), batch_size=4, num_workers=1, start_method="spawn"):
            print(batch)
        """,
        "MainGuardError",
        "worker 'DataLoader-worker-0' died while starting: the main module",
    ),
    "group": (
        """
        from framepipe.workers import WorkerGroup

        def rank_main(x):
            return x

        group = WorkerGroup(rank_main, 2, args=(1,))
        group.start()
        group.wait(60)
        """,
        "GroupFailed",
        "exited with code 121 while starting: the main module starts workers",
    ),
}


@pytest.mark.parametrize("kind", STARTED_AT_IMPORT)
def test_workers_started_at_import_fail_saying_why(tmp_path, kind):
    code, error, says = STARTED_AT_IMPORT[kind]
    out = run_program(code, "file", tmp_path)
    assert out.returncode == 1
    first = exception_line(out.stderr, error)
    assert says in first
    assert '`if __name__ == "__main__":`' in first


def test_main_guard_error_pickles_and_keeps_its_facts():
    import pickle

    err = MainGuardError("pool-0", 42, where="prog.py, line 7", stderr_tail="a\nb")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is MainGuardError and isinstance(back, WorkerStartError)
    assert (back.worker, back.pid, back.where, back.stderr_tail) == (
        "pool-0",
        42,
        "prog.py, line 7",
        "a\nb",
    )
    assert str(back).splitlines()[0] == str(err).splitlines()[0]
    assert str(back).splitlines()[-2:] == ["  a", "  b"]


@pytest.mark.parametrize("how", ["stdin", "c"])
def test_python_dash_and_dash_c_programs_run_spawned_workers(tmp_path, how):
    # as with the stdlib's pools: functions of importable modules run; the program itself
    # is not re-run in the worker (python - has no file to re-run)
    code = """
        import math
        from framepipe.workers import Pool

        if __name__ == "__main__":
            with Pool(1, start_method="spawn") as pool:
                print(pool.submit(math.sqrt, 16).result())
                print(list(pool.map(abs, [-1, -2])))
    """
    out = run_program(code, how, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["4.0", "[1,", "2]"]
    assert "<stdin>" not in out.stderr


@pytest.mark.parametrize("how", ["file", "stdin", "c"])
def test_a_function_the_worker_cannot_find_gets_a_short_error_saying_what_to_do(tmp_path, how):
    # without cloudpickle (with it, such a function goes by value: tests/test_byvalue.py)
    code = """
        import sys
        sys.modules["cloudpickle"] = None
        from framepipe.workers import Pool

        if __name__ == "__main__":
            def cube(x):
                return x ** 3

            with Pool(1, start_method="spawn") as pool:
                pool.submit(cube, 3).result()
    """
    out = run_program(code, how, tmp_path)
    assert out.returncode == 1
    first = exception_line(out.stderr, "TaskUnpicklingError")
    assert re.match(r".*TaskUnpicklingError: task \d+: the worker cannot find 'cube': ", first), (
        first
    )
    if how == "file":
        assert 'defined under `if __name__ == "__main__":`' in first
    else:
        assert "has no file (python -c, python -)" in first
    assert "define it at the top level of a module file" in first
    assert 'start_method="fork"' in first and "framepipe[cloudpickle]" in first
    # one traceback (the caller's), not the worker's twice
    assert out.stderr.count(TRACEBACK) == 1, out.stderr
    assert "RemoteTraceback" not in out.stderr and "AttributeError" not in out.stderr


def test_a_tasks_exception_traceback_is_printed_once(tmp_path):
    code = """
        from framepipe.workers import Pool

        class QuotaError(Exception):
            pass

        def work(x):
            raise QuotaError(f"quota exceeded for {x}")

        if __name__ == "__main__":
            with Pool(1, start_method="spawn") as pool:
                pool.submit(work, 3).result()
    """
    out = run_program(code, "file", tmp_path)
    assert out.returncode == 1
    err = out.stderr
    assert err.rstrip().splitlines()[-1] == "QuotaError: quota exceeded for 3"
    assert "__mp_main__" not in err
    assert err.count('raise QuotaError(f"quota exceeded for {x}")') == 1, err
    assert err.count("quota exceeded for 3") == 1, err
    # the worker's part names the process and starts at the user's frame
    worker_part = err.split('"""')[1]
    assert re.search(r"Traceback from process \d+ \(pool-0\)", worker_part)
    frames = [line for line in worker_part.splitlines() if line.startswith("  File ")]
    assert frames and "prog.py" in frames[0] and "in work" in frames[0], worker_part


def test_a_tasks_exception_still_carries_the_workers_traceback(engine):
    with Pool(1, start_method="fork") as pool:
        exc = pool.submit(identity, None).result(WAIT)  # warm
        assert exc is None
        fut = pool.submit(parse, "not a number")
        err = fut.exception(WAIT)
    assert type(err) is ValueError
    assert err.__traceback__ is None  # the worker's frames are the cause's text, once
    cause = err.__cause__
    assert type(cause).__name__ == "RemoteTraceback"
    assert "Traceback from process" in str(cause)
    assert "in parse" in str(cause) and "_taskloop.py" not in str(cause)
    assert "invalid literal" not in str(cause)  # the exception's own line is not repeated


# -- a drop-in Pipe reader whose writer died ----------------------------------------------------


def test_a_reader_whose_unwatched_writer_died_is_pointed_to_watch(engine):
    import multiprocessing as mp

    r, w = connection.Pipe(duplex=False)
    child = mp.get_context("fork").Process(target=exit_with_pipe_end, args=(w,))
    child.start()
    try:
        child.join(WAIT)
        assert child.exitcode == 0
        # this process still holds the writing end: no end of file, a timeout
        with pytest.raises(framepipe.ReadTimeout) as info:
            r.recv_bytes(timeout=0.2)
        first = str(info.value).splitlines()[0]
        assert first.startswith("timed out after 0.2 s: nothing arrived; ")
        assert "conn.watch(process)" in first and "WriterDied" in first
        # watched, the same read says what happened
        r.watch(child)
        with pytest.raises(framepipe.WriterDied):
            r.recv_bytes(timeout=WAIT)
    finally:
        r.close()
        w.close()


def test_a_watched_readers_timeout_does_not_point_to_watch(engine):
    r, w = connection.Pipe(duplex=False)
    with r, w:
        r.watch(os.getppid())
        with pytest.raises(framepipe.ReadTimeout) as info:
            r.recv_bytes(timeout=0.05)
        assert str(info.value).startswith("timed out after 0.05 s: between frames")
        assert "watch" not in str(info.value)


@pytest.mark.parametrize("timeout", [-1, 0])
def test_a_read_that_does_not_wait_says_so(engine, timeout):
    r, w = connection.Pipe(duplex=False)
    with r, w:
        with pytest.raises(framepipe.ReadTimeout) as info:
            r.recv_bytes(timeout=timeout)
        first = str(info.value).splitlines()[0]
        assert first.startswith(f"no frame had arrived (timeout={timeout} does not wait")
        assert "timed out after" not in first


# -- crash reports ------------------------------------------------------------------------------


def test_a_native_crash_report_puts_the_users_frame_first_and_says_it_once(engine, capfd):
    with Pool(1, start_method="fork") as pool:
        fut = pool.submit(abort_now)
        with pytest.raises(WorkerCrashed) as info:
            fut.result(WAIT)
    text = str(info.value)
    lines = text.splitlines()
    assert lines[0].startswith("worker 'pool-0' (pid ")
    assert "was killed by SIGABRT while running" in lines[0] and "abort_now" in lines[0]
    assert len(lines) <= 12, text
    at = lines.index("native traceback:")
    assert lines[at + 1] == "Fatal Python error: Aborted"
    current = next(i for i, line in enumerate(lines) if line.startswith("Current thread"))
    # its first frame (faulthandler may write "Garbage-collecting" above it: a forked child
    # keeps the flag of a collection the parent was in at the fork)
    first = next(line for line in lines[current + 1 :] if line.lstrip().startswith("File "))
    assert "_message_tasks.py" in first and "abort_now" in first
    assert "_serve_health" not in text and "framepipe's own threads left out: 1" in text
    assert text.count("Fatal Python error") == 1
    # the raw dump stays in the attribute; the console got its first line only
    assert "_serve_health" in info.value.native_traceback
    err = capfd.readouterr().err
    assert err.count("Fatal Python error") == 1, err
    assert "its native traceback is in the crash report" in err
    assert "Current thread" not in err and "_serve_health" not in err


def test_a_crash_report_keeps_to_twelve_lines_whatever_the_worker_wrote(engine, capfd):
    with Pool(1, start_method="fork") as pool:
        with pytest.raises(WorkerCrashed) as info:
            pool.submit(talk_then_die, 30).result(WAIT)
    lines = str(info.value).splitlines()
    assert "was killed by SIGKILL while running" in lines[0]
    assert len(lines) <= 12, lines
    assert lines[-1] == "progress line 29"
    assert any(line.startswith("last stderr (the last ") for line in lines)
    assert "progress line 10" in info.value.stderr_tail  # the attribute keeps 20 lines
    capfd.readouterr()


def test_a_task_timeout_shows_the_stuck_frame_first(engine):
    with Pool(1, start_method="fork", task_timeout=0.5) as pool:
        fut = pool.submit(hang)
        with pytest.raises(TaskTimeout) as info:
            fut.result(WAIT)
    text = str(info.value)
    lines = text.splitlines()
    assert re.match(r"worker 'pool-0' \(pid \d+\) did not finish .*hang.* within 0.5 s", lines[0])
    assert len(lines) <= 12, text
    current = next(i for i, line in enumerate(lines) if line.startswith("Current thread"))
    assert lines[current - 1] == "its stack when the deadline passed:"
    assert "in hang" in lines[current + 1] or "in hang" in lines[current + 2]
    assert "_serve_health" not in text
    assert "_serve_health" in (info.value.stack or "")  # the attribute keeps the whole dump


def test_tidy_dump_orders_threads_and_leaves_text_that_is_no_dump_alone():
    pkg = os.path.dirname(framepipe.__file__)
    dump = (
        "Fatal Python error: Segmentation fault\n\n"
        "Thread 0x0000000000000002 (most recent call first):\n"
        f'  File "{pkg}/connection.py", line 1 in wait\n'
        f'  File "{pkg}/workers/_process.py", line 2 in _serve_health\n\n'
        "Thread 0x0000000000000003 (most recent call first):\n"
        '  File "/app/mine.py", line 9 in poller\n\n'
        "Current thread 0x0000000000000001 (most recent call first):\n"
        '  File "/app/mine.py", line 3 in crash\n'
        f'  File "{pkg}/workers/_taskloop.py", line 4 in task_loop\n'
        f'  File "{pkg}/workers/_process.py", line 5 in child_main\n\n'
        "Extension modules: numpy (total: 1)"
    )
    assert tidy_dump(dump).splitlines() == [
        "Fatal Python error: Segmentation fault",
        "",
        "Current thread 0x0000000000000001 (most recent call first):",
        '  File "/app/mine.py", line 3 in crash',
        "  ... 2 more frames below (framepipe's and Python's own)",
        "",
        "Thread 0x0000000000000003 (most recent call first):",
        '  File "/app/mine.py", line 9 in poller',
        "",
        "(framepipe's own threads left out: 1)",
        "Extension modules: numpy (total: 1)",
    ]
    assert tidy_dump("no dump here\n") == "no dump here"


def test_tidy_dump_folds_the_frames_a_forked_worker_has_of_its_parent():
    # below the worker's entry (child_main), a forked worker's stack goes on with the frames
    # the parent had when it forked, the parent's own code among them: not the worker's
    pkg = os.path.dirname(framepipe.__file__)
    dump = (
        "Current thread 0x0000000000000001 (most recent call first):\n"
        '  File "/app/data.py", line 9 in __getitem__\n'
        f'  File "{pkg}/workers/loader/worker.py", line 2 in fetch\n'
        f'  File "{pkg}/workers/_child.py", line 190 in child_main\n'
        f'  File "{pkg}/workers/_child.py", line 298 in _launch\n'
        f'  File "{pkg}/workers/loader/dataloader.py", line 293 in __iter__\n'
        '  File "/app/train.py", line 16 in <module>\n'
    )
    assert tidy_dump(dump).splitlines() == [
        "Current thread 0x0000000000000001 (most recent call first):",
        '  File "/app/data.py", line 9 in __getitem__',
        "  ... 5 more frames below (framepipe's and Python's own, and the forking parent's)",
    ]
    # a forked worker idle in its loop: no frame of its own is the user's, the parent's folded
    idle = dump.replace('  File "/app/data.py", line 9 in __getitem__\n', "")
    assert tidy_dump(idle).splitlines() == [
        "Current thread 0x0000000000000001 (most recent call first):",
        f'  File "{pkg}/workers/loader/worker.py", line 2 in fetch',
        f'  File "{pkg}/workers/_child.py", line 190 in child_main',
        "  ... 3 more frames below (framepipe's and Python's own, and the forking parent's)",
    ]
    # a spawned worker: below its entry, multiprocessing's own frames only, and no parent
    stdlib = os.path.dirname(multiprocessing.__file__)
    spawned = (
        "Current thread 0x0000000000000001 (most recent call first):\n"
        '  File "/app/data.py", line 9 in __getitem__\n'
        f'  File "{pkg}/workers/_child.py", line 190 in child_main\n'
        f'  File "{stdlib}/process.py", line 108 in run\n'
        f'  File "{stdlib}/spawn.py", line 120 in spawn_main\n'
        '  File "<string>", line 1 in <module>\n'
    )
    assert tidy_dump(spawned).splitlines() == [
        "Current thread 0x0000000000000001 (most recent call first):",
        '  File "/app/data.py", line 9 in __getitem__',
        "  ... 4 more frames below (framepipe's and Python's own)",
    ]


def test_worker_output_is_copied_line_by_line(engine, capfd):
    with Worker(start_method="fork") as w:
        fut = w.submit(write_in_two_parts, "first half, ", "second half", 0.5)
        time.sleep(0.2)
        sys.stderr.write("a line of the parent's\n")
        sys.stderr.flush()
        fut.result(WAIT)
        w.ping(WAIT)
        time.sleep(0.2)  # the copy happens as the manager reads the pipe
    err = capfd.readouterr().err.splitlines()
    assert "first half, second half" in err, err
    assert "a line of the parent's" in err, err


# -- small ones ---------------------------------------------------------------------------------


def test_an_unpicklable_argument_fails_its_future_naming_it(engine):
    # at result(), as concurrent.futures (code written for it catches it there), and not
    # before the worker has it: nothing is queued
    lock = threading.Lock()
    with Pool(1, start_method="fork") as pool:
        with pytest.raises(pickle.PicklingError) as info:
            pool.submit(identity, lock).result(WAIT)
        first = str(info.value).splitlines()[0]
        assert first.startswith("cannot send argument 0 of ")
        assert "identity" in first and "_thread.lock cannot be pickled" in first
        with pytest.raises(TypeError, match=r"^cannot send keyword argument 'x' of "):
            pool.submit(identity, x=lock).result(WAIT)
        if importlib.util.find_spec("cloudpickle") is None:
            with pytest.raises(TypeError, match=r"^cannot send the function .*cloudpickle"):
                pool.submit(lambda: 1).result(WAIT)
        else:  # by value (tests/test_byvalue.py)
            assert pool.submit(lambda: 1).result(WAIT) == 1
            with pytest.raises(TypeError, match=r"^cannot send argument 0 of .* even by value"):
                pool.submit(identity, lambda: lock).result(WAIT)
        assert pool.submit(identity, 5).result(WAIT) == 5
        # map: the item that cannot be sent fails in its place, naming its argument
        it = pool.map(max, [1, lock], [2, 3])
        assert next(it) == 2
        with pytest.raises(TypeError, match=r"^cannot send argument 0 of max .*_thread.lock"):
            next(it)
    with Worker(start_method="fork") as w:
        with pytest.raises(TypeError, match=r"^cannot send argument 1 of "):
            w.call(max, 1, lock)


@pytest.mark.parametrize("bad", ["4", 2.0, True])
def test_pool_size_of_the_wrong_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match=r"^max_workers must be an int, not "):
        Pool(bad)
    with pytest.raises(ValueError, match="positive"):
        Pool(0)


def _noop(*args):
    return None


# Each refused at the call, before any process starts: a value of the wrong type is a TypeError,
# one out of range a ValueError, and the message names the argument and what it takes.
BAD_SETTINGS = [
    (lambda: Pool(1, max_task_crashes="2"), TypeError, r"^max_task_crashes must be an int >= 1 "),
    (lambda: Pool(1, max_task_crashes=None), TypeError, r"^max_task_crashes must be an int"),
    (lambda: Pool(1, max_rss="1G"), TypeError, r"^max_rss must be an int >= 1 or None \(bytes\)"),
    (lambda: Pool(1, max_tasks_per_worker=0), ValueError, r"^max_tasks_per_worker must be an int"),
    (lambda: Pool(1, max_restarts="3"), TypeError, r"^max_restarts must be an int >= 0 or None"),
    (
        lambda: Pool(1, kill_grace="1"),
        TypeError,
        r"^kill_grace must be a finite number of seconds >= 0",
    ),
    (lambda: Pool(1, restart_window="x"), TypeError, r"^restart_window must be a number of sec"),
    (lambda: Pool(1, task_timeout="1"), TypeError, r"^task_timeout must be a number of seconds"),
    (lambda: Pool(1, start_method=5), TypeError, r"^start_method must be a str, not int"),
    (lambda: Pool(1, start_method=""), ValueError, r"^unknown start_method ''; this platform has"),
    (lambda: Pool(1, initializer=_noop, initargs="ab"), TypeError, r"initargs=\(value,\)"),
    (lambda: Pool(1, env=5), TypeError, r"^env must be a Mapping or None, not int"),
    (lambda: Pool(1, cwd="/nonexistent/dir"), FileNotFoundError, r"^cwd '/nonexistent/dir' is not"),
    (lambda: Pool(1, tee="yes"), TypeError, r"^tee must be a bool, not str"),
    (lambda: Pool(1, name=5), TypeError, r"^name must be a str, not int"),
    (lambda: Worker(cwd=__file__), NotADirectoryError, r"is not a directory: the worker processes"),
    (lambda: DataLoader([1, 2], batch_size=2.5), ValueError, r"^batch_size must be an int >= 1 "),
    (lambda: DataLoader([1, 2], batch_size="2"), ValueError, r"\(None: items one by one\)"),
    (lambda: DataLoader([1], num_workers=2, start_method="forks"), ValueError, r"start_method"),
    (
        lambda: DataLoader([1], num_workers=2, multiprocessing_context=5),
        TypeError,
        r"^multiprocessing_context must be a start method",
    ),
    (lambda: DataLoader([1], num_workers="2"), TypeError, r"^num_workers must be an int >= 0"),
    (lambda: framepipe.Pipe(timeout_callback=5), TypeError, r"^timeout_callback must be a call"),
    (
        lambda: framepipe.Pipe(timeout="1"),
        TypeError,
        r"^timeout must be a number of seconds, not str",
    ),
    (lambda: framepipe.Pipe(read_handle="x"), TypeError, r"^read_handle must be an int >= 0"),
]


@pytest.mark.parametrize("make, kind, message", BAD_SETTINGS)
def test_a_bad_setting_is_refused_at_the_call_naming_it(make, kind, message):
    with pytest.raises(kind, match=message):
        made = make()
        made.close()  # (not reached: a test that gets here fails, its object closed)


def test_the_settings_that_were_accepted_still_are(engine):
    # what the checks above must not refuse: NumPy numbers, any iterable of initargs but a
    # string, an infinite restart window or timeout, a Path, os.environ
    np = pytest.importorskip("numpy")
    with Pool(
        np.int64(1),
        start_method="fork",
        initializer=_noop,
        initargs=(x for x in [1, 2]),
        task_timeout=np.float64(30),
        restart_window=float("inf"),
        max_rss=np.int64(2**40),
        cwd=Path(__file__).parent,
        env=os.environ,
    ) as pool:
        assert pool.submit(identity, 3).result(WAIT) == 3
        assert list(pool.map(identity, range(3), chunksize=np.int64(2))) == [0, 1, 2]
    loader = DataLoader(list(range(4)), batch_size=np.int64(2), timeout=float("inf"))
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]


def test_bad_arguments_of_calls_are_refused_at_the_call(engine):
    with Pool(1, start_method="fork") as pool:
        for kw in ({"chunksize": "2"}, {"chunksize": 2.0}, {"buffersize": "2"}):
            with pytest.raises(TypeError, match=r"^(chunksize|buffersize) must be an int >= 1"):
                pool.map(identity, [1], **kw)
        with pytest.raises(TypeError, match=r"^buffersize must be an int >= 1"):
            pool.imap_unordered(identity, [1], buffersize="2")
        # a chunk with an item that cannot be sent names the function and the argument
        items = pool.map(identity, [1, threading.Lock(), 3], chunksize=2)
        with pytest.raises(TypeError, match=r"^cannot send argument 0 of .*identity .*_thread"):
            next(items)
    with Worker(start_method="fork") as w:
        for call in (w.call, w.submit, w.stream):
            with pytest.raises(TypeError, match=r"^fn must be a callable \(the function to run"):
                call(5)
        with pytest.raises(TypeError, match=r"^window must be an int >= 1"):
            w.stream(identity, window="2")
        with pytest.raises(TypeError, match=r"^timeout must be a number of seconds"):
            w.call(identity, 1, timeout="1")
        with pytest.raises(ValueError, match=r"^timeout must be a number of seconds > 0, not -1"):
            w.ping(timeout=-1)
        assert w.call(identity, 7) == 7  # refused before anything was sent
    # a poll timeout that is a string: a TypeError in both engines, as in the stdlib
    a, b = connection.Pipe()
    try:
        with pytest.raises(TypeError, match="must be real number, not str"):
            a.poll("1")
    finally:
        a.close()
        b.close()


def test_pool_pids_are_known_right_after_construction(engine):
    with Pool(2, start_method="fork") as pool:
        pids = pool.pids
        assert len(pids) == 2 and len(set(pids)) == 2 and os.getpid() not in pids


def test_an_initializer_that_exits_is_reported_as_the_initializers_with_its_stderr(engine):
    pool = Pool(
        1,
        start_method="fork",
        initializer=exit_after_saying,
        initargs=("config file missing: /etc/app.toml",),
    )
    try:
        with pytest.raises(PoolBroken) as info:
            pool.submit(identity, 1).result(WAIT)
    finally:
        pool.shutdown()
    cause = info.value.__cause__
    assert isinstance(cause, WorkerStartError)
    first = str(cause).splitlines()[0]
    assert re.fullmatch(
        r"the initializer of worker 'pool-0' \(pid \d+\) called sys.exit\(1\)", first
    )
    assert "config file missing: /etc/app.toml" in str(cause)
    assert "the task raised" not in str(info.value) and "the task raised" not in str(cause)
    assert str(info.value).splitlines()[0] == "pool is broken: " + first


def test_a_worker_dying_before_ready_says_while_starting(engine):
    pool = Pool(1, start_method="fork", initializer=os._exit, initargs=(3,))
    try:
        with pytest.raises(PoolBroken) as info:
            pool.submit(identity, 1).result(WAIT)
    finally:
        pool.shutdown()
    first = str(info.value).splitlines()[0]
    assert first.endswith("exited with code 3 while starting"), first
    assert isinstance(info.value.__cause__.__cause__, WorkerCrashed)
    assert info.value.__cause__.__cause__.starting


def test_python_m_framepipe_version():
    out = run_python("-m", "framepipe", "--version", timeout=RUN)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"framepipe {framepipe.__version__} (")
    assert f"{framepipe.implementation} engine" in out.stdout


# -- output width -------------------------------------------------------------------------------


def test_output_width_follows_the_terminal_and_defaults_to_100(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    r, w = os.pipe()
    try:
        assert output_width(w) == 100  # a pipe: no terminal
    finally:
        os.close(r)
        os.close(w)
    monkeypatch.setenv("COLUMNS", "72")
    assert output_width(w) == 72
    assert table.width() == 72
    lines = wrap_line("   | " + "word " * 40, 40)
    assert all(len(line) <= 40 for line in lines) and all(
        line.startswith("   | ") for line in lines
    )


@pytest.mark.parametrize("columns", [None, "70"])
def test_the_demo_fits_the_width_and_writes_whole_lines(tmp_path, columns):
    env = {"COLUMNS": columns} if columns else {}
    full = child_env(**env)
    if columns is None:
        full.pop("COLUMNS", None)
    out = run_python("-m", "framepipe", "demo", timeout=RUN, env=full, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    width = int(columns or 100)
    long = [line for line in out.stdout.splitlines() if len(line) > width]
    assert not long, long
    assert "WorkerCrashed: worker 'demo-" in out.stdout
    assert "TaskTimeout after 1 s" in out.stdout
    # the raised exception's cause is the worker's traceback, down to the task's own frame
    # (read without the quotes' bars and without white space: a line wrapped at 70 columns
    # goes on after "   | ", broken between words or, a long path, anywhere in it)
    text = "".join(re.sub(r"\n\s*\|", "\n", out.stdout).split())
    quota = text.split("2.Sixresizetasks")[0]
    assert "itscause,theworker'straceback:" in quota, out.stdout
    assert re.search(r'_demo\.py",line\d+,incheck_quota', quota), out.stdout
    # the hung task's stack: its own frame, the worker loop's below it folded into one line
    hang = text.split("3.Ataskhangs")[1]
    assert re.search(r'_demo\.py",line\d+inwait_for_lock', hang), out.stdout
    assert "moreframesbelow(framepipe'sandPython'sown" in hang, out.stdout
    # the worker's stderr line arrived whole
    assert "resize: image 3 is huge, allocating..." in out.stderr.splitlines()


def test_the_bench_verdict_explains_a_busy_machine_and_how_to_get_a_clean_figure(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    busy = {"steal": 0.12, "others": 0.4, "load_before": 3.1, "cpus": 2}
    lines = bench_load.busy_lines(busy, [1.1, 2.4], missed=3)
    text = " ".join(lines)
    assert text.startswith("the machine was busy during this run: ")
    assert "12% of the CPU time was stolen" in text
    assert "other processes used 40%" in text
    assert "load average was 3.1 on 2 CPUs" in text
    assert "up to 2.4x" in text
    assert "The 3 missed target(s) may be the load's" in text
    assert "For a clean figure" in text
    idle = {"steal": 0.0, "others": 0.01, "load_before": 0.1, "cpus": 2}
    assert bench_load.busy_lines(idle, [1.05]) == []
    # the probe reads this machine (Linux): shares between 0 and 1
    probe = bench_load.LoadProbe()
    sum(range(10**5))
    got = probe.finish()
    assert got["cpus"] >= 1
    for key in ("steal", "others"):
        assert got[key] is None or 0 <= got[key] <= 1


def test_the_bench_table_carries_the_verdict_once_and_fits(monkeypatch):
    from test_bench_cli import _synthetic_report

    monkeypatch.setenv("COLUMNS", "80")
    report = _synthetic_report()
    report["load"] = {"steal": 0.05, "others": 0.0, "load_before": 0.0, "cpus": 2}
    text = table.format_report(report)
    assert all(len(line) <= 80 for line in text.splitlines()), text
    flat = " ".join(text.split())
    assert flat.count("the machine was busy during this run: 5% of the CPU time was stolen") == 1
    report["load"] = {"steal": 0.0, "others": 0.0, "load_before": 0.0, "cpus": 2}
    report["rows"] = [r for r in report["rows"] if not r.get("runs")]
    assert "busy" not in table.format_report(report)
