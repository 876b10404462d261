# The engine interface, written down once: framepipe._core (compiled) and framepipe._pycore
# (its twin) both implement Engine exactly so, private names included; tests/test_engine_switch.py
# checks every name and signature below against both. framepipe._connection.ConnectionBase
# provides the ConnectionHooks the engine calls back, and each engine's Connection
# (framepipe._connection_c, framepipe._connection_py) derives from it and the engine.
#
# Deadlines are absolute monotonic seconds (time.monotonic(), CLOCK_MONOTONIC); negative: none.
from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from _typeshed import ReadableBuffer, WriteableBuffer

from .watch import Liveness

ENGINE: str
"""``"c"`` here, ``"python"`` in the twin."""

def _may_spin() -> bool:
    """Whether a read may spin now (see _spin.may_spin)."""

class ConnectionHooks(Protocol):
    """What the Connection above the engine provides; the engine calls these."""

    def _message(self, kind: int, payload: Any, deadline: float, raw: bool, maxlength: int) -> Any:
        """The rest of a message that is not one data frame (``kind`` -1: an object's buffers
        are still due), read with ``_read_frame``; called holding the read lock."""
    def _dead_sentinel(self, status: int) -> BaseException:
        """The error for a DEAD sentinel carrying ``status`` read off the stream."""

class Engine(ConnectionHooks):
    ENGINE: ClassVar[str]

    # -- state (read only above the engine, except _peer and _object) ------------------------
    _fd: int  # the read fd, -1 once closed
    _readable: bool
    _writable: bool
    _read_ahead: bool
    _records: bool  # reads take whole records: a SOCK_SEQPACKET socket (see _wire.RECORD_MAX)
    _rpad: bool  # reads padded messages (see _wire.PAD_MIN)
    _wpad: bool  # writes them
    _waited: float  # moving average of reads' waits for data, in seconds (see SPIN); 0 or normal
    _max_size: int | None
    _liveness: Liveness | None
    _sentinel_sent: int  # bytes of DEAD sentinels the watcher wrote through this write end
    _peer: Callable[[], Any] | None  # weakref to this process's connection of the other end
    _object: Any  # an object message in progress (set by the _message hook)

    def _open(
        self,
        fd: int,
        wfd: int,
        bfd: int,
        bwfd: int,
        readable: bool,
        writable: bool,
        max_size: int | None,
        closefd: bool,
        read_ahead: bool,
    ) -> None: ...
    # Close the fds (those owned, and the engine's own), the wake fd and the liveness given to
    # _set_liveness; while another thread is inside a call, wake it and leave the closing to
    # the last call to leave.
    def _close(self) -> None: ...
    def _set_liveness(self, liveness: Liveness | None) -> None: ...
    def _handles(self) -> tuple[int, int, int, int]: ...
    def _has_buffered(self) -> bool: ...
    @property
    def _pending_bulk_fd(self) -> int | None: ...
    @property
    def _liveness_fd(self) -> int | None: ...
    @property
    def _eof_wait(self) -> float | None: ...
    def _lost(self) -> tuple[int, int | None]: ...
    def _break(self, exc: BaseException) -> BaseException: ...

    # -- reading -----------------------------------------------------------------------------
    def recv_bytes(
        self, maxlength: int | None = None, *, timeout: float | None = None
    ) -> bytes: ...
    def recv_bytes_into(
        self, buf: WriteableBuffer, offset: int = 0, *, timeout: float | None = None
    ) -> int: ...
    def recv(self, *, timeout: float | None = None) -> Any: ...
    def poll(self, timeout: float | None = 0.0) -> bool: ...
    def _read_frame(self, deadline: float, mutable: bool) -> tuple[int, Any]: ...

    # -- writing -----------------------------------------------------------------------------
    def send_bytes(self, buf: ReadableBuffer, offset: int = 0, size: int | None = None) -> None: ...
    def _send_segments(self, segments: list[Any]) -> None: ...
    def _write_sentinel(self, data: bytes) -> None: ...
    def _lock_write_nowait(self) -> bool: ...
    def _unlock_write(self) -> None: ...
    def _write_nowait(self, parts: list[Any], bulk: bool) -> int: ...
