"""What ``WorkerGroup`` offers a supervisor built on it (``framepipe.run``'s elastic agent):
per-rank paths, stream plans and labels, how long each rank has been quiet, and the stack a
rank dumped as it died. No torch needed."""

from __future__ import annotations

import os
import sys
import time

import pytest
from _helpers import wait_dead

from framepipe.workers import GroupFailed, Std, WorkerGroup

TIMEOUT = 60.0

CHATTY_AND_QUIET = (
    "import os, sys, time\n"
    "rank = os.environ['RANK']\n"
    "print('hello from', rank, flush=True)\n"
    "for i in range(2000):\n"
    "    if rank == '0':\n"
    "        print('tick', i, flush=True)\n"
    "    time.sleep(0.02)\n"
)

SEGFAULT = "import ctypes\ndef crash_in_c():\n    ctypes.string_at(0)\ncrash_in_c()\n"


class _Labelled(WorkerGroup):
    """A supervisor's layout: its own file names, every stream through a pipe, stdout of
    rank 1 kept off the console, its own labels."""

    def _rank_paths(self, rank: int, base: str) -> tuple[str | None, str | None, str]:
        d = os.path.join(base, f"r{rank}")
        return os.path.join(d, "out.txt"), os.path.join(d, "err.txt"), os.path.join(d, "e.json")

    def _stream_plan(self, rank: int, which: Std, path: str | None) -> str:
        return "quiet" if rank == 1 else "prefix"

    def _label(self, rank: int) -> str:
        return f"node7:rank{rank + 10}"


def test_quiet_for_tells_a_silent_rank_from_a_chatty_one(tmp_path):
    group = _Labelled([sys.executable, "-u", "-c", CHATTY_AND_QUIET], 2, log_dir=tmp_path)
    try:
        group.start()
        deadline = time.monotonic() + TIMEOUT
        while True:
            quiet = group.quiet_for()
            if quiet[1] >= 1.0:
                break
            assert time.monotonic() < deadline, quiet
            time.sleep(0.05)
        assert sorted(quiet) == [0, 1]
        assert quiet[0] < quiet[1]
        pids = list(group.pids.values())
    finally:
        group.close(grace=5.0)
    assert not wait_dead(pids)
    # paths, plans and labels from the subclass
    assert (tmp_path / "r0" / "out.txt").read_text().startswith("hello from 0\ntick 0\n")
    assert (tmp_path / "r1" / "out.txt").read_text() == "hello from 1\n"
    assert group.error_files == {
        0: str(tmp_path / "r0" / "e.json"),
        1: str(tmp_path / "r1" / "e.json"),
    }


def test_console_lines_carry_the_label_and_quiet_ranks_stay_off(tmp_path, capfd):
    code = "import os; print('line of', os.environ['RANK'], flush=True)"
    with _Labelled([sys.executable, "-c", code], 2, log_dir=tmp_path) as group:
        group.wait(TIMEOUT)
    out, _ = capfd.readouterr()
    assert "[node7:rank10] line of 0\n" in out
    assert "line of 1" not in out
    assert (tmp_path / "r1" / "out.txt").read_text() == "line of 1\n"


def test_a_native_crash_outcome_has_the_dumped_stack(tmp_path):
    group = WorkerGroup([sys.executable, "-X", "faulthandler", "-c", SEGFAULT], 1)
    with pytest.raises(GroupFailed) as info, group:
        group.wait(TIMEOUT)
    root = info.value.root
    assert root is not None and root.signal_name == "SIGSEGV"
    assert root.native_stack is not None
    assert root.native_stack.startswith("Fatal Python error: Segmentation fault")
    assert "in crash_in_c" in root.native_stack


def test_no_native_stack_without_a_dump():
    group = WorkerGroup([sys.executable, "-c", "import sys; sys.exit(3)"], 1)
    with pytest.raises(GroupFailed) as info, group:
        group.wait(TIMEOUT)
    assert info.value.root is not None and info.value.root.native_stack is None
