"""WorkerGroup: real processes, both engines for the result channel."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from _helpers import alive, child_env, wait_dead

import framepipe
from framepipe.workers import GroupFailed, GroupResult, Std, WorkerError, WorkerGroup

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in [os.path.abspath(p) for p in sys.path]:
    sys.path.insert(0, HERE)

import _group_children as kids  # noqa: E402 - needs the sys.path entry above

SRC = os.path.dirname(os.path.dirname(os.path.abspath(framepipe.__file__)))
TIMEOUT = 60.0  # a hang guard only
METHODS = [
    m for m in ("fork", "spawn", "forkserver") if m in multiprocessing.get_all_start_methods()
]


def failure_of(group: WorkerGroup) -> GroupFailed:
    """Start ``group`` if it is not running yet and return the GroupFailed its wait raises."""
    if not group.pids:
        group.start()
    with pytest.raises(GroupFailed) as info:
        group.wait(TIMEOUT)
    return info.value


def no_zombie_children() -> list[psutil.Process]:
    return [
        c for c in psutil.Process().children(recursive=True) if c.status() == psutil.STATUS_ZOMBIE
    ]


@pytest.fixture
def groups():
    """Groups made with ``groups.make(...)`` are closed at the end whatever happens."""

    class Made(list):
        def make(self, *args, **kwargs):
            kwargs.setdefault("grace", 2.0)
            group = WorkerGroup(*args, **kwargs)
            self.append(group)
            return group

    made = Made()
    yield made
    pids = []
    for group in made:
        pids += [p for p in group.pids.values() if p]
        group.close(grace=1.0)
    assert not wait_dead(pids, 10.0), "a rank outlived its group"


@pytest.fixture
def parents():
    """Parent processes (running groups) started with ``parents.start(mode)``; at the end,
    each is SIGKILLed with every process below it."""

    class Started(list):
        def start(self, mode: str, ready: bool = True) -> tuple[subprocess.Popen, list[int]]:
            proc = subprocess.Popen(
                [sys.executable, os.path.join(HERE, "_group_children.py"), mode],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=child_env(),
            )
            self.append(proc)
            if not ready:
                return proc, []
            line = proc.stdout.readline()
            assert line, proc.stderr.read().decode()
            return proc, json.loads(line)["ready"]

    started = Started()
    yield started
    for proc in started:
        try:
            below = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            below = []
        proc.kill()
        for p in below:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
        proc.communicate(timeout=TIMEOUT)


# -- results, environment, start methods --------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_function_ranks_return_values_with_their_environment(engine, groups, method):
    group = groups.make(
        kids.identity,
        3,
        args={0: ("a",), 1: ("b", 2)},
        envs={2: {"EXTRA": "yes"}},
        start_method=method,
    )
    group.start()
    result = group.wait(TIMEOUT)
    assert isinstance(result, GroupResult)
    values = result.return_values
    assert [values[r]["args"] for r in range(3)] == [("a",), ("b", 2), ()]
    for r in range(3):
        assert values[r]["env"] == {
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": "3",
            "EXTRA": "yes" if r == 2 else None,
        }
        assert values[r]["pid"] == group.pids[r]
        assert values[r]["pgid"] == values[r]["pid"]  # each rank leads its own process group
        assert values[r]["error_file"] == group.error_files[r]
    assert result.exitcodes == {0: 0, 1: 0, 2: 0}
    assert group.poll() is result or group.poll() == result


def test_command_ranks_return_exit_codes(groups, tmp_path):
    group = groups.make(
        ["sh", "-c", 'echo "$RANK/$LOCAL_RANK/$WORLD_SIZE/$EXTRA $0 $1"'],
        2,
        args={0: ("x", "y"), 1: ("z", "w")},
        envs={1: {"EXTRA": "e"}},
        log_dir=tmp_path,
    )
    with group:
        result = group.wait(TIMEOUT)
    assert result.exitcodes == {0: 0, 1: 0}
    assert result.return_values == {0: None, 1: None}
    assert (tmp_path / "0" / "stdout.log").read_text() == "0/0/2/ x y\n"
    assert (tmp_path / "1" / "stdout.log").read_text() == "1/1/2/e z w\n"


def test_command_pid_is_the_command_and_its_launcher_leads_the_group(groups):
    group = groups.make(["sh", "-c", "sleep 30"], 1)
    group.start()
    pid = group.pids[0]
    proc = psutil.Process(pid)
    assert proc.cmdline()[:2] == ["sh", "-c"]
    launcher = proc.parent()
    assert launcher.ppid() == os.getpid()
    assert os.getpgid(pid) == launcher.pid
    os.kill(pid, signal.SIGKILL)  # a signal to the pid reaches the command itself
    err = failure_of(group)
    assert err.root.exitcode == -signal.SIGKILL  # the launcher exits as it did
    assert "was killed by SIGKILL" in str(err)


def test_missing_command_fails_start_and_leaves_nothing(fd_count):
    children = {c.pid for c in psutil.Process().children()}
    before = fd_count()
    group = WorkerGroup(["/nonexistent/program-xyz"], 2)
    with pytest.raises(FileNotFoundError, match="rank 0"):
        group.start()
    group.close()
    assert {c.pid for c in psutil.Process().children()} <= children
    assert fd_count() == before


# -- the root cause ------------------------------------------------------------------------


@pytest.mark.parametrize("first", [0, 1])
def test_root_cause_is_the_earliest_error_file_not_the_first_death(engine, groups, first):
    """Both ranks raise, 0.3 s apart. The first to raise takes 1 s more to die, so the
    other's death is seen first: its error file's time still makes it the root cause."""
    t0 = time.time() + 1.0
    second = 1 - first
    group = groups.make(
        kids.fail_at,
        2,
        args={first: (t0, first, 1.0), second: (t0 + 0.3, second, 0.0)},
        start_method="fork",
    )
    err = failure_of(group)
    assert err.root_rank == first
    root = err.root
    # it was stopped while it lingered: its error file tells what it raised, and where
    assert root.exception is None and root.exitcode == -signal.SIGTERM
    assert root.error.message["message"] == f"ValueError: rank {first} failed first"
    assert "in _raise_at" in root.traceback
    assert root.error.timestamp_ns is not None
    # the other died of its exception, which came back revived with its traceback
    assert isinstance(err.failures[second].exception, ValueError)
    assert str(err.failures[second].exception) == f"rank {second} failed first"
    # the other raised on its own, 0.3 s later (give or take the scheduler on a loaded
    # machine): a failure too, but not the root
    assert set(err.failures) == {0, 1}
    assert 0.05 < err.failures[second].failed_at - root.failed_at < 1.0
    assert err.outcomes[second].ended_at < err.outcomes[first].ended_at
    text = str(err)
    assert text.startswith(
        f"worker group 'fail_at' failed: rank {first} (pid {root.pid}) "
        f"raised ValueError: rank {first} failed first"
    )
    assert text.index("root cause:") < text.index("Traceback") < text.index("other ranks:")
    assert re.search(rf"^  rank {second} \(pid \d+\): also failed: raised ValueError", text, re.M)


@pytest.mark.parametrize("first", [0, 1])
def test_root_cause_of_two_ranks_failing_50_ms_apart(engine, groups, first, tmp_path):
    """The second rank raises 50 ms after the first one's error file appears; the first
    lingers 1 s before it dies, so the second's death is seen first. The error files decide."""
    second = 1 - first
    first_file = str(tmp_path / str(first) / "error.json")
    group = groups.make(
        kids.fail_after,
        2,
        args={first: (None, 0.0, first, 1.0), second: (first_file, 0.05, second, 0.0)},
        start_method="fork",
        log_dir=tmp_path,
    )
    err = failure_of(group)
    assert err.root_rank == first
    assert err.root.error.message["message"] == f"ValueError: rank {first} failed first"
    assert err.outcomes[second].ended_at < err.outcomes[first].ended_at  # seen dead first
    assert 0.05 <= err.failures[second].failed_at - err.root.failed_at < 1.0
    assert str(err).startswith(
        f"worker group 'fail_after' failed: rank {first} (pid {err.root.pid}) "
        f"raised ValueError: rank {first} failed first"
    )


@pytest.mark.parametrize("first", [0, 1])
def test_root_cause_without_error_files_is_the_first_death(engine, groups, first):
    # the second rank would exit 1 s after the first: the group stops it well before
    t0 = time.time() + 1.0
    group = groups.make(
        kids.exit_at, 2, args={first: (t0, 3), 1 - first: (t0 + 1.0, 4)}, start_method="fork"
    )
    err = failure_of(group)
    assert err.root_rank == first
    assert err.root.exitcode == 3 and err.root.error is None
    other = err.outcomes[1 - first]
    assert other.state == "stopped" and other.exitcode == -signal.SIGTERM
    assert str(err).startswith(
        f"worker group 'exit_at' failed: rank {first} (pid {err.root.pid}) exited with code 3"
    )
    assert re.search(
        rf"rank {1 - first} \(pid \d+\): stopped by the group; it was killed by "
        "SIGTERM",
        str(err),
    )


@pytest.mark.parametrize("first", [0, 1])
def test_command_root_cause_by_error_file(groups, first, tmp_path):
    """Commands that use @framepipe.record find their error file in the environment."""
    script = (
        "import sys, framepipe\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "import _group_children as kids\n"
        "path = sys.argv[2] or None\n"
        "kids.fail_after(path, float(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))\n"
    )
    # The first rank raises at once and dies 0.4 s later; the second raises 0.05 s after the
    # first one's error file appears and dies at once: the error files, not the exits, say
    # which failed first, whatever the scheduler does.
    second = 1 - first
    first_file = str(tmp_path / str(first) / "error.json")
    group = groups.make(
        [sys.executable, "-c", script, HERE],
        2,
        args={first: ("", 0.0, first, 0.4), second: (first_file, 0.05, second, 0.0)},
        envs=dict.fromkeys(range(2), {"PYTHONPATH": SRC}),
        log_dir=tmp_path,
    )
    err = failure_of(group)
    assert err.root_rank == first
    assert err.root.exception is None  # commands have no result channel...
    assert err.root.error.py_callstack.rstrip().endswith(f"rank {first} failed first")
    assert f"raised ValueError: rank {first} failed first" in str(err).split("\n")[0]
    assert err.root.error_file == str(tmp_path / str(first) / "error.json")


def test_a_rank_killed_by_a_signal_is_reported_with_it(groups):
    group = groups.make(
        kids.kill_self, 2, args={0: (signal.SIGKILL,), 1: (0,)}, start_method="fork"
    )
    err = failure_of(group)
    assert err.root_rank == 0 and err.root.signal_name == "SIGKILL"
    assert err.root.exception is None and err.root.error is None
    assert str(err).startswith(
        f"worker group 'kill_self' failed: rank 0 (pid {err.root.pid}) was killed by SIGKILL"
    )
    assert err.outcomes[1].state == "stopped"


def test_report_shows_the_exception_traceback_and_log_tail(engine, groups, tmp_path):
    group = groups.make(
        kids.fail_with_output,
        3,
        args={r: (r,) for r in range(3)},
        log_dir=tmp_path,
        start_method="fork",
    )
    err = failure_of(group)
    assert isinstance(err, WorkerError)
    root = err.root
    assert isinstance(root.exception, KeyError)
    assert root.stderr_tail == "about to fail"  # the traceback is shown once, above
    text = str(err)
    assert (
        f"last stderr of rank {root.rank} (whole log: {root.stderr_path}):\n  | about to "
        "fail" in text
    )
    assert "KeyError: 'missing item" in text
    assert len(re.findall(r"^  rank \d \(pid \d+\): ", text, re.M)) == 2
    clone = pickle.loads(pickle.dumps(err))
    assert str(clone) == text and clone.root_rank == err.root_rank


def test_a_stop_without_failure_is_reported_as_such(groups):
    group = groups.make(kids.sleep_forever, 2, start_method="fork")
    group.start()
    with pytest.raises(TimeoutError):
        group.wait(0.2)
    assert group.poll() is None
    group.close(grace=5.0)
    failure = group.poll()
    assert isinstance(failure, GroupFailed)
    assert failure.root_rank is None and not failure.failures
    assert str(failure).startswith("worker group 'sleep_forever' was stopped: close() was called")
    assert all(o.state == "stopped" for o in failure.outcomes.values())
    with pytest.raises(GroupFailed):
        group.wait()


# -- logs and tee --------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_per_rank_log_files_keep_c_level_output(engine, groups, tmp_path, method):
    group = groups.make(
        kids.write_outputs, 2, args={0: (0,), 1: (1,)}, log_dir=tmp_path, start_method=method
    )
    with group:
        assert group.wait(TIMEOUT).return_values == {0: "written", 1: "written"}
    for r in range(2):
        d = tmp_path / str(r)
        assert sorted(p.name for p in d.iterdir()) == ["stderr.log", "stdout.log"]
        out = (d / "stdout.log").read_text().splitlines()
        err = (d / "stderr.log").read_text().splitlines()
        assert sorted(out) == sorted([f"python stdout of rank {r}", f"fd 1 of rank {r}"])
        assert sorted(err) == sorted([f"python stderr of rank {r}", f"fd 2 of rank {r}"])
        assert group.stdouts[r] == str(d / "stdout.log")


def test_redirects_and_tee_per_rank(engine, groups, tmp_path, capfd):
    group = groups.make(
        kids.write_outputs,
        2,
        args={0: (0,), 1: (1,)},
        log_dir=tmp_path,
        redirects={0: Std.ERR},
        tee={1: Std.OUT},
        start_method="fork",
    )
    with group:
        group.wait(TIMEOUT)
    out, err = capfd.readouterr()
    # rank 0: stderr to its file only, stdout to the console as is
    assert not (tmp_path / "0" / "stdout.log").exists()
    assert "fd 2 of rank 0" in (tmp_path / "0" / "stderr.log").read_text()
    assert "fd 1 of rank 0\n" in out and "[0]" not in out
    # rank 1: stdout to its file and to the console with a prefix; stderr to the console
    assert "fd 1 of rank 1" in (tmp_path / "1" / "stdout.log").read_text()
    assert "[1] fd 1 of rank 1\n" in out and "[1] python stdout of rank 1\n" in out
    assert not (tmp_path / "1" / "stderr.log").exists()
    assert "fd 2 of rank 1\n" in err and "[1] fd 2" not in err


def test_error_file_lands_beside_the_logs(groups, tmp_path):
    group = groups.make(kids.fail_with_output, 1, args=(0,), log_dir=tmp_path, start_method="fork")
    group.start()
    with pytest.raises(GroupFailed):
        group.wait(TIMEOUT)
    data = json.loads((tmp_path / "0" / "error.json").read_text())
    assert data["message"]["message"] == "KeyError: 'missing item 0'"
    assert "fail_with_output" in data["message"]["extraInfo"]["py_callstack"]


def test_tee_prefixes_whole_lines_never_interleaved(parents):
    proc, _ = parents.start("tee", ready=False)
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err.decode()
    for stream in (out, err):
        seen = {0: 0, 1: 0}
        for line in stream.decode().splitlines():
            m = re.fullmatch(r"\[(\d)\] r(\d) (\d+) (y*)", line)
            assert m, f"not a whole prefixed line: {line!r}"
            rank, inner, n, pad = int(m[1]), int(m[2]), int(m[3]), m[4]
            assert rank == inner and n == seen[rank] and len(pad) == n % 50
            seen[rank] += 1
        assert seen == {0: 3000, 1: 3000}


def test_ten_megabytes_on_stderr_do_not_block(engine, groups, tmp_path, capfd):
    size = 10 * 10**6
    start = time.monotonic()
    piped = groups.make(kids.big_stderr, 1, args=(size,), start_method="fork")
    to_file = groups.make(kids.big_stderr, 1, args=(size,), log_dir=tmp_path, start_method="fork")
    teed = groups.make(
        kids.big_stderr, 1, args=(size,), log_dir=tmp_path / "tee", tee=Std.ERR, start_method="fork"
    )
    for group in (piped, to_file, teed):
        group.start()
    for group in (piped, to_file, teed):
        assert group.wait(TIMEOUT).return_values == {0: size}
    assert time.monotonic() - start < 20
    _, err = capfd.readouterr()
    assert len(err) == 2 * size + size // 100 * len("[0] ")  # as is, then with prefixes
    assert os.path.getsize(tmp_path / "0" / "stderr.log") == size
    assert os.path.getsize(tmp_path / "tee" / "0" / "stderr.log") == size


# -- stopping ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["function", "command"])
def test_close_escalates_to_sigkill_after_grace(groups, kind, tmp_path):
    marks = [tmp_path / f"ignoring-{r}" for r in range(2)]
    if kind == "function":
        group = groups.make(
            kids.ignore_term_and_sleep,
            2,
            args={r: (str(marks[r]),) for r in range(2)},
            start_method="fork",
        )
    else:
        group = groups.make(
            ["sh", "-c", "trap '' TERM; touch \"$0\"; sleep 600"],
            2,
            args={r: (str(marks[r]),) for r in range(2)},
        )
    group.start()
    end = time.monotonic() + TIMEOUT
    while not all(m.exists() for m in marks) and time.monotonic() < end:
        time.sleep(0.01)  # until every rank has set SIGTERM aside
    pids = list(group.pids.values())
    start = time.monotonic()
    group.close(grace=0.5)
    took = time.monotonic() - start
    assert 0.45 <= took < 10
    failure = group.poll()
    assert all(o.exitcode == -signal.SIGKILL for o in failure.outcomes.values())
    assert not wait_dead(pids, 0.0)
    assert not no_zombie_children()


def test_close_returns_once_a_killed_command_has_ended(groups, tmp_path):
    # The escalation's SIGKILL reaches a command's launcher and the command at once; the
    # launcher dies before it can wait for its command, which the kernel is still tearing
    # down (here 256 MB of touched memory: milliseconds at least). close() waits for the
    # command itself, so no rank's process is still running when it returns.
    mark = tmp_path / "ignoring"
    program = (
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "b = bytearray(256 << 20)\n"
        "b[::4096] = b'x' * len(b[::4096])\n"
        "pathlib.Path(sys.argv[1]).touch()\n"
        "time.sleep(600)\n"
    )
    group = groups.make([sys.executable, "-c", program, str(mark)], 1)
    group.start()
    end = time.monotonic() + TIMEOUT
    while not mark.exists() and time.monotonic() < end:
        time.sleep(0.01)
    assert mark.exists()
    pids = list(group.pids.values())
    group.close(grace=0.2)
    assert group.poll().outcomes[0].exitcode == -signal.SIGKILL
    assert not wait_dead(pids, 0.0)  # gone, or a zombie: not running any more


def test_a_failure_stops_the_others_at_once(groups):
    t0 = time.time() + 0.5
    group = groups.make(
        kids.exit_at, 3, args={0: (t0, 5), 1: (t0 + 60, 0), 2: (t0 + 60, 0)}, start_method="fork"
    )
    group.start()
    start = time.monotonic()
    err = failure_of(group)
    assert time.monotonic() - start < 5
    assert [o.state for o in err.outcomes.values()] == ["failed", "stopped", "stopped"]


@pytest.mark.parametrize("mode", ["wait-fn", "wait-cmd"])
def test_sigterm_to_the_parent_is_forwarded_to_the_group(parents, mode):
    proc, pids = parents.start(mode)
    below = psutil.Process(proc.pid).children(recursive=True)
    assert len(pids) == 2
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == -signal.SIGTERM, err.decode()  # the parent still dies of it
    assert b"Traceback" not in err
    assert not wait_dead([p.pid for p in below], 5.0)


def test_sigint_to_the_parent_ends_with_one_traceback(parents):
    proc, pids = parents.start("wait-fn")
    below = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=TIMEOUT)
    text = err.decode()
    assert proc.returncode == -signal.SIGINT, text  # how Python ends on KeyboardInterrupt
    assert text.count("Traceback") == 1 and text.rstrip().endswith("KeyboardInterrupt")
    assert not wait_dead([p.pid for p in below], 5.0)


def test_groups_left_running_are_stopped_at_interpreter_exit(parents):
    # multiprocessing's own exit hook would join a running function rank forever: the shared
    # at-exit registry stops every group first (the death signal, then SIGKILL)
    proc, pids = parents.start("exit")  # (it may be stopping them already: pids only)
    assert len(pids) == 4
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err
    assert not wait_dead(pids, 5.0)


def test_parent_sigkilled_leaves_no_worker_alive(parents):
    proc, pids = parents.start("hold")
    below = psutil.Process(proc.pid).children(recursive=True)
    assert len(pids) == 4 and set(pids) <= {p.pid for p in below}
    proc.kill()
    proc.wait(TIMEOUT)
    time.sleep(2.0)
    assert [p.pid for p in below if alive(p.pid)] == []


def _run_groups(tmp_path) -> list[int]:
    pids = []
    for kwargs in (
        {"start_method": "fork"},
        {"start_method": "spawn", "log_dir": tmp_path},
        {"start_method": "forkserver"},
    ):
        with WorkerGroup(kids.identity, 2, tee=Std.ALL, **kwargs) as group:
            group.wait(TIMEOUT)
        pids += group.pids.values()
        with WorkerGroup(kids.fail_with_output, 2, args=(1,), **kwargs) as group:
            with pytest.raises(GroupFailed):
                group.wait(TIMEOUT)
        pids += group.pids.values()
    with WorkerGroup(["sh", "-c", "exit $RANK"], 2, tee=Std.ERR) as group:
        with pytest.raises(GroupFailed):
            group.wait(TIMEOUT)
    pids += group.pids.values()
    return pids


def test_no_zombie_and_no_fd_left(engine, fd_count, tmp_path):
    _run_groups(tmp_path)  # the process-wide helpers (forkserver, trackers) start here
    before = fd_count()
    children = {c.pid for c in psutil.Process().children()}
    pids = _run_groups(tmp_path)
    assert fd_count() == before
    assert {c.pid for c in psutil.Process().children()} <= children  # reaped, every one
    assert not no_zombie_children()
    assert not [p for p in pids if psutil.pid_exists(p) and alive(p)]
    assert not [t for t in threading.enumerate() if t.name.startswith("framepipe-group")]


# -- asyncio -------------------------------------------------------------------------------


def test_asyncio_wait_and_aclose(engine):
    async def main():
        async with WorkerGroup(kids.identity, 2, args=(7,), start_method="fork") as group:
            result = await group.wait_async(TIMEOUT)
            assert [result.return_values[r]["args"] for r in range(2)] == [(7,), (7,)]
        sleeper = WorkerGroup(kids.sleep_forever, 2, start_method="fork")
        await sleeper.astart()
        with pytest.raises(TimeoutError):
            await sleeper.wait_async(0.2)
        waiter = asyncio.ensure_future(sleeper.wait_async())
        await asyncio.sleep(0.05)
        await sleeper.aclose(grace=5.0)
        with pytest.raises(GroupFailed, match="close"):
            await waiter
        return sleeper.pids

    pids = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert not wait_dead(list(pids.values()), 0.0)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="nprocs"):
        WorkerGroup(kids.identity, 0)
    with pytest.raises(ValueError, match="outside"):
        WorkerGroup(kids.identity, 2, args={2: ()})
    with pytest.raises(ValueError, match="log_dir"):
        WorkerGroup(kids.identity, 2, redirects=Std.ALL)
    with pytest.raises(ValueError, match="start_method"):
        WorkerGroup(kids.identity, 2, start_method="teleport")
    for grace in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="grace must be a finite number of seconds >= 0"):
            WorkerGroup(kids.identity, 2, grace=grace)
    # a value of the wrong type is a TypeError that names the argument and what it takes
    wrong = [
        ({"nprocs": "2"}, "nprocs must be an int >= 1"),
        ({"nprocs": 2.0}, "nprocs must be an int >= 1"),
        ({"grace": "30"}, "grace must be a finite number of seconds >= 0"),
        ({"args": 5}, r"args must be a tuple of each rank's arguments, not int \(5\)"),
        ({"args": {1: "ab"}}, r"args\[1\] must be a tuple of rank 1's arguments"),
        ({"envs": {0: 5}}, r"envs\[0\] must be a Mapping"),
        ({"entrypoint": 5}, "entrypoint must be a function each rank calls, or a command"),
        ({"entrypoint": None}, "entrypoint must be a function each rank calls, or a command"),
    ]
    for change, message in wrong:
        kw = {"entrypoint": kids.identity, "nprocs": 2, **change}
        with pytest.raises(TypeError, match=message):
            WorkerGroup(kw.pop("entrypoint"), kw.pop("nprocs"), **kw)
    with pytest.raises(ValueError, match="death_sig 999 is not a signal of this platform"):
        WorkerGroup(kids.identity, 2, death_sig=999)
    group = WorkerGroup(kids.identity, 1)
    with pytest.raises(RuntimeError, match="start"):
        group.wait()


def test_a_start_that_fails_in_with_releases_what_it_opened(tmp_path):
    # with-statement: __exit__ never runs when start() raises in __enter__, so start() itself
    # lets go of what it opened (the wake-up pipe), and wait() says it never ran
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with pytest.raises(NotADirectoryError):
            with WorkerGroup(kids.identity, 2, log_dir=str(not_a_dir)):
                pass
    assert len(os.listdir("/proc/self/fd")) == fds
    group = WorkerGroup(kids.identity, 2, log_dir=str(not_a_dir))
    with pytest.raises(NotADirectoryError):
        group.start()
    with pytest.raises(RuntimeError, match=r"never ran: it was closed, or its start\(\) raised"):
        group.wait()
