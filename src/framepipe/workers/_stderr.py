"""The parent's end of a worker's output: a pipe drained into a tail, a log file, the console.

A worker's fd 2 (and, for a group rank, maybe fd 1) is the write end of a pipe; the parent
reads it without blocking (:meth:`OutputPipe.pump`, called when the pipe is readable) into a
tail kept for crash reports, an optional log file, and optionally this process's console, line
by line (never a worker's half line in the middle of another's) with a ``[name]`` prefix or as
written. :func:`open_output` makes the pipe; :func:`file_tail` and :func:`native_dump` read the
same facts back from a log file when no pipe was kept.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
import time

__all__ = [
    "STDERR_DRAIN",
    "TAIL_BYTES",
    "TAIL_LINES",
    "OutputPipe",
    "file_tail",
    "native_dump",
    "open_output",
    "read_available",
    "write_console",
]

TAIL_BYTES = 64 * 1024
TAIL_LINES = 20


def read_available(fd: int) -> tuple[bytes, bool]:
    """Every byte readable now from a non-blocking fd: (data, at_eof)."""
    chunks: list[bytes] = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return b"".join(chunks), False
        except InterruptedError:
            continue
        if not chunk:
            return b"".join(chunks), True
        chunks.append(chunk)


STDERR_DRAIN = 0.2  # seconds a crash report waits for the rest of a dead worker's stderr


class OutputPipe:
    """The parent's end of a worker's stderr pipe: a tail for reports, optional log file,
    optional console copy (raw, or line by line with a ``[name]`` prefix)."""

    def __init__(
        self,
        fd: int,
        name: str,
        log_path: str | None,
        console: str | None,
        console_stream: str = "stderr",
    ) -> None:
        self.fd: int | None = fd
        self.name = name
        self.log_path = log_path
        self.console = console  # None, "raw" or "prefix"
        self.console_stream = console_stream  # the parent's "stderr" or "stdout"
        self.tail = bytearray()
        self._partial = b""
        self._dumping = False  # a fatal error's dump is being written: not copied
        # the manager and a caller that saw the death may both pump: one at a time, so what
        # one of them read is in the tail before the other reports it
        self._lock = threading.Lock()
        self._log = open(log_path, "ab", buffering=0) if log_path else None  # noqa: SIM115

    def pump(self) -> bool:
        """Move what the worker wrote to the sinks; True at end of file."""
        with self._lock:
            if self.fd is None:
                return True
            data, eof = read_available(self.fd)
            if data:
                self._feed(data)
            if eof:
                self._flush_partial()
            return eof

    def drain(self, timeout: float) -> None:
        """Pump until end of file (the dead worker's last words), for at most ``timeout``
        seconds (a grandchild may still hold the pipe's write end)."""
        end = time.monotonic() + timeout
        while not self.pump():
            fd, left = self.fd, end - time.monotonic()
            if fd is None or left <= 0:
                return
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            with contextlib.suppress(OSError):
                poller.poll(left * 1000.0)

    def _feed(self, data: bytes) -> None:
        self.tail += data
        if len(self.tail) > TAIL_BYTES:
            del self.tail[: len(self.tail) - TAIL_BYTES]
        if self._log is not None:
            with contextlib.suppress(OSError):
                self._log.write(data)
        if self.console is None:
            return
        # Copied line by line (never a worker's half line in the middle of another's), and
        # without the native dump of a crash, which its WorkerCrashed report shows.
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > TAIL_BYTES:  # a very long line: copied in pieces
            lines.append(self._partial)
            self._partial = b""
        self._copy(lines)

    def _copy(self, lines: list[bytes]) -> None:
        prefix = f"[{self.name}] ".encode() if self.console == "prefix" else b""
        out = []
        for line in lines:
            if self._dumping:
                continue
            if line.startswith(b"Fatal Python error"):
                self._dumping = True
                line += b" (its native traceback is in the crash report)"
            out.append(prefix + line + b"\n")
        if out:
            write_console(b"".join(out), self.console_stream)

    def _flush_partial(self) -> None:
        if self.console is not None and self._partial:
            self._copy([self._partial])
        self._partial = b""

    def tail_text(self, lines: int = TAIL_LINES) -> str:
        text = bytes(self.tail).decode("utf-8", "replace")
        return "\n".join(text.rstrip("\n").split("\n")[-lines:]) if text.strip() else ""

    def native_traceback(self) -> str | None:
        return native_dump(bytes(self.tail).decode("utf-8", "replace"))

    def close_in_child(self) -> None:
        """In a worker forked from this process: close the descriptors, leave the sinks."""
        fds = [self.fd, self._log.fileno() if self._log is not None else None]
        for fd in fds:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.pump()
        self._flush_partial()
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)
        if self._log is not None:
            self._log.close()
            self._log = None


def write_console(data: bytes, stream: str = "stderr") -> None:
    console = getattr(sys, stream)
    with contextlib.suppress(OSError):
        # what the parent wrote to that stream first (its stdout is left alone: flushed from
        # here, between the pieces of a print(), it would show a half line)
        try:
            console.flush()
        except (AttributeError, ValueError):
            pass
        fd = console.fileno() if console is not None else (1 if stream == "stdout" else 2)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]


def open_output(
    name: str, log_path: str | None, console: str | None, stream: str = "stderr"
) -> tuple[OutputPipe, int]:
    """A pipe for a worker's output: the parent's :class:`OutputPipe` on its read end
    (non-blocking) and the write end, to hand to the worker and close here once it started."""
    read, write = os.pipe()
    os.set_blocking(read, False)
    return OutputPipe(read, name, log_path, console, stream), write


def native_dump(text: str) -> str | None:
    """The fatal error's dump at the end of ``text`` (``Fatal Python error: ...`` on), if any."""
    at = text.rfind("Fatal Python error")
    return text[at:].rstrip() if at >= 0 else None


def file_tail(path: str) -> str | None:
    """The last :data:`TAIL_BYTES` of the log file ``path``, as text; None when unreadable."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - TAIL_BYTES))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None
