"""Functions the worker tests run in worker processes (importable by spawn and forkserver
children: pytest puts this directory on sys.path and multiprocessing passes it on)."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import sys
import time

from framepipe.workers import worker_namespace


class TwoArgError(Exception):
    """An exception whose constructor takes two required arguments."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"code {code}: {detail}")
        self.code = code
        self.detail = detail


def add(a, b):
    return a + b


def identity(x):
    return x


def square(x):
    return x * x


def getpid(_=None):
    return os.getpid()


def env(name):
    return os.environ.get(name)


def cwd():
    return os.getcwd()


def raise_two_arg(code, detail):
    raise TwoArgError(code, detail)


def raise_key(key):
    raise KeyError(key)


def raise_system_exit(code):
    raise SystemExit(code)


def kill_self_if(x, victims):
    """Return x * 2, unless x is in ``victims``: then say so on stderr and die by SIGKILL."""
    if x in victims:
        os.write(2, f"task {x} is about to die\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)
    return x * 2


def die_with(message, sig=signal.SIGKILL):
    os.write(2, message.encode() + b"\n")
    os.kill(os.getpid(), sig)
    time.sleep(10)


def exit_hard(code):
    os._exit(code)


def segfault():
    ctypes.string_at(0)


def sleep_for(seconds):
    time.sleep(seconds)
    return seconds


def miss_a_cancel_then_sleep(ready_path, seconds):
    """Let the first cancel signal go by unseen, as one that lands just before a blocking call
    begins does, then sleep ``seconds``: only a signal sent again interrupts the sleep."""
    from framepipe.workers._child import CANCEL_SIGNAL

    missed = []
    handler = signal.signal(CANCEL_SIGNAL, lambda signum, frame: missed.append(signum))
    try:
        open(ready_path, "w").close()
        while not missed:
            time.sleep(0.001)
    finally:
        signal.signal(CANCEL_SIGNAL, handler)
    time.sleep(seconds)
    return len(missed)


def hang_in_sleep_loop():
    while True:
        time.sleep(0.01)


def stuck_in_c_holding_the_gil():
    # catastrophic backtracking: seconds in the regex engine without releasing the GIL
    return re.match(r"(a+)+$", "a" * 32 + "b")


def count_up(n, progress_file=None, closed_file=None):
    """Yield 0..n-1, recording in ``progress_file`` how many were produced, and in
    ``closed_file`` that the generator was closed."""
    try:
        for i in range(n):
            if progress_file:
                with open(progress_file, "w") as f:
                    f.write(str(i + 1))
            yield i
    finally:
        if closed_file:
            with open(closed_file, "w") as f:
                f.write("closed")


def slow_items(n, delay):
    for i in range(n):
        time.sleep(delay)
        yield i


def yield_then_hang():
    yield 1
    while True:
        time.sleep(0.01)


def append_to(name, value):
    worker_namespace().setdefault(name, []).append(value)


def write_stderr(nbytes):
    chunk = b"x" * 1023 + b"\n"
    left = nbytes
    while left > 0:
        n = min(left, len(chunk))
        os.write(2, chunk[:n])
        left -= n
    return nbytes


def print_to_stderr(text):
    print(text, file=sys.stderr, flush=True)
    return text


def hold_memory(nbytes):
    worker_namespace()["ballast"] = bytearray(nbytes)
    return os.getpid()


def set_global(value):
    global _initialized
    _initialized = value


_initialized = None


def get_global():
    return _initialized


def failing_initializer():
    raise TwoArgError(7, "no database")


def array(nbytes):
    import numpy as np

    return np.full(nbytes, 7, dtype=np.uint8)


def filled(nbytes, value):
    import numpy as np

    return np.full(nbytes, value, dtype=np.uint8)


def filled_pair(nbytes, value):
    import numpy as np

    return ("pair", np.full(nbytes, value, dtype=np.uint8), {"n": nbytes})


def join_cgroup(path):
    """An initializer: move this worker into the cgroup at ``path``."""
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def allocate_until_killed(step, pause):
    """Hold ``step`` more bytes (every page written) every ``pause`` seconds, forever: only the
    OOM killer ends it."""
    held = []
    while True:
        held.append(b"\x01" * step)
        time.sleep(pause)


def sleep_then_die(seconds):
    time.sleep(seconds)
    os.kill(os.getpid(), signal.SIGKILL)


def sleep_then_record(seconds, path, value):
    """Sleep, then append ``value`` and this worker's pid to the file ``path`` (a line)."""
    time.sleep(seconds)
    with open(path, "a") as f:
        f.write(f"{value} {os.getpid()}\n")
    return value


def wait_for_file(path, limit=60.0):
    """Return once ``path`` exists (False after ``limit`` seconds): a task that runs exactly as
    long as the test wants."""
    end = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def ignore_sigterm_then_hang():
    """Hang in a loop that SIGTERM does not end (only the ladder's SIGKILL does)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(0.01)


class Unreadable:
    """Pickles in the worker; unpickling it anywhere raises (ModuleNotFoundError, as for a
    class only the worker can import, or KeyboardInterrupt, as a Ctrl-C landing there)."""

    def __init__(self, kind):
        self.kind = kind

    def __reduce__(self):
        return (refuse_to_unpickle, (self.kind,))


def refuse_to_unpickle(kind):
    if kind == "interrupt":
        raise KeyboardInterrupt
    raise ModuleNotFoundError("No module named 'only_in_the_worker'")


def unreadable_result(kind, delay=0.0):
    time.sleep(delay)
    return Unreadable(kind)


def items_with_an_unreadable_one(n, bad_at):
    for i in range(n):
        yield Unreadable("import") if i == bad_at else i


def may_spin(_=None):
    """Whether this worker's reads may spin before they sleep."""
    from framepipe._spin import may_spin as spin_allowed

    return spin_allowed()


def spin_state(_=None):
    """This worker's pid, whether its reads may spin and for how long at most."""
    from framepipe._spin import may_spin as spin_allowed
    from framepipe._spin import spin_window as window

    return os.getpid(), spin_allowed(), window()


def spin_state_after(path):
    """``spin_state()`` once ``path`` exists: tasks held until the test lets them go, so that
    the dispatch spreads them over every worker."""
    assert wait_for_file(path)
    return spin_state()


def spin_window(_=None):
    """How long this worker's reads may spin now, in seconds (see framepipe._spin.SPIN_ALONE)."""
    from framepipe._spin import spin_window as window

    return window()


class SpinDataset:
    """Each item: whether the loader worker that loaded it may spin (see may_spin)."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return may_spin()


_PARENT = os.getpid()  # the test process (a forked worker has another pid)


def _only_in_the_parent():
    if os.getpid() != _PARENT:
        raise ValueError("this function cannot be rebuilt in a worker")
    return len


class FunctionOfTheParent:
    """A callable that pickles in the test process and cannot be unpickled in a worker."""

    def __reduce__(self):
        return (_only_in_the_parent, ())

    def __call__(self, *args):
        return len(args)


def nap(seconds):
    """Sleep, then return (this worker's pid, seconds, when it ended)."""
    time.sleep(seconds)
    return os.getpid(), seconds, time.monotonic()


def kill_self_unless_marked(path):
    """Die by SIGKILL the first time (creating ``path``), return this pid once it exists."""
    if not os.path.exists(path):
        with open(path, "w"):
            pass
        os.kill(os.getpid(), signal.SIGKILL)
    return os.getpid()


def die_always():
    os.kill(os.getpid(), signal.SIGKILL)


def die_after_items(n):
    """Yield 0..n-1, then die by SIGKILL."""
    yield from range(n)
    os.kill(os.getpid(), signal.SIGKILL)


def kill_once_at(x, victim, path):
    """Return x * 2; at item ``victim``, die by SIGKILL the first time (creating ``path``)."""
    if x == victim and not os.path.exists(path):
        with open(path, "w"):
            pass
        os.kill(os.getpid(), signal.SIGKILL)
    return x * 2


def fail_at(x, bad):
    """Return x + 1; raise ValueError at item ``bad``."""
    if x == bad:
        raise ValueError(f"item {x} is bad")
    return x + 1


def unreadable_at(x, bad):
    """Return x; at item ``bad``, a result the parent cannot unpickle."""
    return Unreadable("import") if x == bad else x


def slow_below(x, n, seconds):
    """Return x, after sleeping ``seconds`` when x < n."""
    if x < n:
        time.sleep(seconds)
    return x
