"""End to end: a worker under framepipe.guard that crashes in C code, or raises, and the
parent that reads from it (both cores, fork and spawn children)."""

from __future__ import annotations

import multiprocessing
import signal

import pytest
from _fault_children import TwoArgError, guarded_crash, guarded_raise

from framepipe import RemoteTraceback, WriterDied

WAIT = 60.0


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_segfault_reaches_the_parent_with_the_native_traceback(impl, method):
    parent, child = impl.pipe(True)
    proc = multiprocessing.get_context(method).Process(target=guarded_crash, args=(child,))
    proc.start()
    try:
        child.close()
        parent.watch(proc)
        assert parent.recv_bytes(timeout=WAIT) == b"before the crash"
        with pytest.raises(WriterDied) as info:
            parent.recv_bytes(timeout=WAIT)
        err = info.value
        assert err.pid == proc.pid
        assert err.exitcode == -signal.SIGSEGV
        assert err.signal_name == "SIGSEGV"
        assert err.native_traceback is not None
        assert "Segmentation fault" in err.native_traceback
        assert "crash_in_c_code" in err.native_traceback
        assert "guarded_crash" in err.native_traceback
        assert "Segmentation fault" in str(err) and "crash_in_c_code" in str(err)
        # the guard's label names the worker in the parent's message
        assert err.label == "crasher"
        assert str(err).startswith(f"crasher {proc.pid} was killed by signal SIGSEGV")
        proc.join(WAIT)
        assert proc.exitcode == -signal.SIGSEGV  # never reaped by framepipe
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(WAIT)
        parent.close()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_guarded_exception_is_raised_by_recv(impl, method):
    parent, child = impl.pipe(True)
    proc = multiprocessing.get_context(method).Process(target=guarded_raise, args=(child,))
    proc.start()
    try:
        child.close()
        parent.watch(proc)
        with pytest.raises(TwoArgError) as info:
            parent.recv(timeout=WAIT)
        err = info.value
        assert err.args == ("bad batch", 7)
        assert (err.what, err.index) == ("bad batch", 7)
        import traceback

        text = "".join(traceback.format_exception(err))
        assert "guarded_raise" in text
        # the guard's label names the worker in the parent's message
        assert f"Traceback from raiser process {proc.pid} (" in text
        end = err.__cause__
        assert isinstance(end, RemoteTraceback) and end.label == "raiser"
        # After the error frame, the worker's exit is reported, not a hang.
        with pytest.raises(WriterDied) as died:
            parent.recv(timeout=WAIT)
        assert died.value.exitcode == 1
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(WAIT)
        parent.close()
