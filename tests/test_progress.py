"""progress= of Pool.map / imap / imap_unordered and DataLoader: output captured from a real
pseudo-terminal (a child process whose stderr is a pty), with and without tqdm."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import textwrap
import time

import pytest

import framepipe
from framepipe.workers import DataLoader, Pool
from framepipe.workers._progress import Progress

WAIT = 60  # a hang guard only
# the directory that holds the framepipe under test (installed, or src/ in a checkout)
SRC = os.path.dirname(os.path.dirname(os.path.abspath(framepipe.__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))


pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def _on_a_terminal(code: str, no_tqdm: bool = False) -> tuple[int, str, str]:
    """Run ``code`` in a child whose stderr is a pseudo-terminal: (exit code, what the
    terminal showed, stdout)."""
    code = textwrap.dedent(code)
    if no_tqdm:
        code = "import sys\nsys.modules['tqdm'] = None\nsys.modules['tqdm.auto'] = None\n" + code
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # 120 columns
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([SRC, TESTS, os.environ.get("PYTHONPATH", "")]),
        COLUMNS="120",
        TERM="xterm",
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
        env=env,
    )
    os.close(slave)
    seen = bytearray()
    try:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child closed its end
                    break
                if not chunk:
                    break
                seen += chunk
            elif proc.poll() is not None:
                break
        out = proc.stdout.read().decode() if proc.stdout else ""
        rc = proc.wait(WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
        os.close(master)
    return rc, seen.decode(errors="replace"), out


MAP = """
from framepipe.workers import Pool
if __name__ == "__main__":
    with Pool(2, start_method="fork") as pool:
        print(sum(pool.map(abs, range(-300, 0), progress=True)))
"""


def test_map_with_tqdm_draws_a_bar_on_the_terminal():
    pytest.importorskip("tqdm")
    rc, term, out = _on_a_terminal(MAP)
    assert rc == 0, term
    assert out.strip() == str(sum(range(1, 301)))
    last = term.replace("\r", "\n").strip().splitlines()[-1]
    assert "300/300" in last and "100%" in last
    assert "task/s" in last and "crashes=0" in last and "timeouts=0" in last


def test_map_without_tqdm_writes_one_plain_line():
    rc, term, out = _on_a_terminal(MAP, no_tqdm=True)
    assert rc == 0, term
    assert out.strip() == str(sum(range(1, 301)))
    assert term.endswith("\n") and term.count("\n") == 1  # one line, redrawn in place
    last = term.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("pool: 100% 300/300 tasks, ")
    assert "tasks/s, 0 crashes, 0 timeouts" in last


def test_crashes_and_timeouts_are_counted_on_the_terminal():
    code = """
    import os
    from framepipe.workers import Pool, WorkerCrashed, TaskTimeout
    from _progress_tasks import exit_at_4, sleep_for
    if __name__ == "__main__":
        with Pool(2, start_method="fork", task_timeout=0.5) as pool:
            try:
                list(pool.imap(exit_at_4, range(6), progress=True))
            except WorkerCrashed:
                print("crashed")
            try:
                list(pool.imap_unordered(sleep_for, [0, 0, 30], progress=True))
            except TaskTimeout:
                print("timed out")
    """
    rc, term, out = _on_a_terminal(code, no_tqdm=True)
    assert rc == 0, term
    assert out.split() == ["crashed", "timed", "out"]
    lines = [ln for ln in term.replace("\r", "\n").splitlines() if ln.strip()]
    assert any(ln.endswith("1 crashes, 0 timeouts") and "5/6" in ln for ln in lines), term
    assert any(ln.endswith("0 crashes, 1 timeouts") and "3/3" in ln for ln in lines), term


def test_nothing_is_printed_without_progress():
    code = MAP.replace("progress=True", "progress=None")
    rc, term, out = _on_a_terminal(code)
    assert rc == 0 and out.strip() == str(sum(range(1, 301)))
    assert term == ""


def test_not_a_terminal_without_tqdm_prints_nothing(capfd):
    rc = subprocess.run(
        [sys.executable, "-c", "import sys\nsys.modules['tqdm'] = None\n" + MAP],
        env=dict(os.environ, PYTHONPATH=SRC),
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert rc.returncode == 0 and rc.stderr == ""


def test_a_callable_gets_each_step():
    seen: list[Progress] = []
    with Pool(2, start_method="fork") as pool:
        assert list(pool.imap(abs, range(-5, 0), progress=seen.append)) == [5, 4, 3, 2, 1]
        assert sorted(pool.imap_unordered(abs, [-1, -2], progress=seen.append)) == [1, 2]
        assert list(pool.map(abs, [-3, -4], chunksize=2, progress=seen.append)) == [3, 4]
    assert [(p.done, p.total) for p in seen] == [
        (1, 5),
        (2, 5),
        (3, 5),
        (4, 5),
        (5, 5),
        (1, 2),
        (2, 2),
        (1, 2),
        (2, 2),
    ]
    assert all(p.crashes == 0 and p.timeouts == 0 and p.rate > 0 for p in seen)


def test_a_tqdm_bar_given_is_updated_and_left_open():
    tqdm = pytest.importorskip("tqdm")
    import io

    buf = io.StringIO()
    bar = tqdm.tqdm(file=buf, total=None)
    with Pool(1, start_method="fork") as pool:
        assert list(pool.map(abs, range(-4, 0), progress=bar)) == [4, 3, 2, 1]
    assert bar.n == 4 and bar.total == 4 and not bar.disable
    bar.close()
    assert "4/4" in buf.getvalue()


def test_dataloader_progress():
    seen: list[Progress] = []
    loader = DataLoader(list(range(10)), batch_size=3, num_workers=2, progress=seen.append)
    with loader:
        assert [len(b) for b in loader] == [3, 3, 3, 1]
    assert [(p.done, p.total) for p in seen] == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_a_bad_progress_is_refused_at_once():
    with Pool(1, start_method="fork") as pool:
        with pytest.raises(TypeError, match="progress must be"):
            pool.map(abs, [1], progress="yes")
        with pytest.raises(TypeError, match="progress must be"):
            pool.imap_unordered(abs, [1], progress=3)
    with pytest.raises(TypeError, match="progress must be"):
        DataLoader([1], batch_size=None, num_workers=2, progress=object())
