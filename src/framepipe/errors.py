"""The exceptions framepipe raises.

Each class is also the stdlib class that existing code already catches: a read timeout is a
``TimeoutError``, a protocol error an ``OSError``, a dead writer an ``EOFError`` (what
``multiprocessing.connection`` raises at end of file) and an ``OSError`` (what the reference
``Pipe`` raised).
"""

from __future__ import annotations

import signal as _signal
from collections.abc import Callable
from multiprocessing import BufferTooShort
from typing import Any

__all__ = [
    "FramepipeError",
    "FrameError",
    "MessageTooLong",
    "ReadTimeout",
    "RemoteBaseException",
    "WriterDied",
    "BufferTooShort",
    "signal_name",
]


class FramepipeError(Exception):
    """Base class of every error framepipe defines."""


class FrameError(FramepipeError, OSError):
    """The bytes on the wire are not a valid frame (wrong check bytes, a length over
    ``max_size``, or end of file inside a frame)."""


class MessageTooLong(FrameError):
    """A frame was longer than the ``maxlength`` given to ``recv_bytes``.

    Unlike ``multiprocessing.connection``, the frame's body has been read and discarded, so the
    connection stays usable: the next read returns the next frame.
    """

    def __init__(self, length: int, maxlength: int) -> None:
        self.length = length
        self.maxlength = maxlength
        super().__init__(
            f"bad message length: a frame of {length:,} bytes exceeds maxlength={maxlength:,}; "
            "the frame was discarded and the connection is still usable "
            "(pass a larger maxlength to receive such frames)"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.length, self.maxlength))


class ReadTimeout(FramepipeError, TimeoutError):
    """A read did not complete before its deadline. Nothing is lost: bytes of a frame that had
    started to arrive are kept, and the next read returns the whole frame.

    ``sentinel`` is True when a reference writer's TIMEOUT sentinel caused it, False when this
    read's own deadline passed."""

    sentinel = False


# Looked up when a writer's death is raised: a dict, since the enum's own look-up, the first
# time after a long sleep, took about 18 us of the way from the end of file to the raise.
_SIGNAL_NAMES = {int(s): s.name for s in _signal.Signals}


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; ``SIG<n>`` for a number the platform does not name."""
    try:
        name = _SIGNAL_NAMES.get(signum)
    except TypeError:
        name = None
    return name if name is not None else f"SIG{signum}"


def how_it_ended(exitcode: int | None, core_dumped: bool, *, numbered: bool = False) -> str:
    """How a process ended, for a message: ``exited with code 3``, ``was killed by SIGKILL
    (core dumped)``, ``died (its exit status could not be read)``. ``numbered`` says the
    signal's number too: ``was killed by signal SIGSEGV (11), core dumped``."""
    if exitcode is None:
        return "died (its exit status could not be read)"
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    name = signal_name(-exitcode)
    if numbered:
        dumped = ", core dumped" if core_dumped else ""
        return f"was killed by signal {name} ({-exitcode}){dumped}"
    dumped = " (core dumped)" if core_dumped else ""
    return f"was killed by {name}{dumped}"


class WriterDied(FramepipeError, EOFError, OSError):
    """The process writing to this connection died (any exit code, 0 included, or a signal).

    Frames it wrote before dying have been delivered by earlier reads. Attributes:

    ``pid``, ``exitcode`` (negative for a signal, as ``subprocess.Popen`` reports it; ``None``
    when the exit status could not be read), ``signal_name``, ``core_dumped``, ``lost_bytes``
    (bytes of a partial frame that had arrived), ``expected_bytes`` (the size of that frame,
    header included, when known), ``label`` (what the message calls the writer),
    ``oom_killed`` (``True`` when the cgroup's OOM-kill counter rose while the writer lived,
    ``None`` when unknown) and ``native_traceback`` (the faulthandler dump of a worker run
    under :func:`framepipe.guard`, when it crashed in C code).

    ``details``, when given, is called once, on first use of ``label``, ``oom_killed``,
    ``native_traceback`` or the message, and returns those three: a reader that meets a death
    raises at once and reads the dead writer's diagnostics (a file look-up and a cgroup
    counter) only when someone looks at them.
    """

    def __init__(
        self,
        pid: int | None,
        exitcode: int | None = None,
        *,
        core_dumped: bool = False,
        lost_bytes: int = 0,
        expected_bytes: int | None = None,
        oom_killed: bool | None = None,
        native_traceback: str | None = None,
        label: str = "worker",
        details: Callable[[], tuple[str, bool | None, str | None]] | None = None,
    ) -> None:
        super().__init__()
        self.pid = pid
        self.exitcode = exitcode
        self.core_dumped = core_dumped
        self.lost_bytes = lost_bytes
        self.expected_bytes = expected_bytes
        self.signal_name = signal_name(-exitcode) if exitcode is not None and exitcode < 0 else None
        self._details = details
        self._resolved = (label, oom_killed, native_traceback)
        self._message_text: str | None = None
        self._args_set = False  # args assigned: they, not the message, are the args

    def _resolve(self) -> tuple[str, bool | None, str | None]:
        # Two threads that look at once may both call details(): it returns the same thing
        # (a Liveness reads its diagnostics once and keeps them). Kept only once it returned.
        details = self._details
        if details is not None:
            try:
                self._resolved = details()
            except Exception:  # noqa: BLE001 - a diagnostic that fails must never hide the death
                pass
            self._details = None
        return self._resolved

    @property
    def label(self) -> str:
        return self._resolve()[0]

    @property
    def oom_killed(self) -> bool | None:
        return self._resolve()[1]

    @property
    def native_traceback(self) -> str | None:
        return self._resolve()[2]

    @property
    def args(self) -> tuple[object, ...]:
        if self._args_set:
            value: tuple[object, ...] = BaseException.args.__get__(self)  # type: ignore[attr-defined]
            return value
        return (str(self),)

    @args.setter
    def args(self, value: tuple[object, ...]) -> None:
        BaseException.args.__set__(self, value)  # type: ignore[attr-defined]
        self._args_set = True

    def __str__(self) -> str:
        if self._args_set:
            return BaseException.__str__(self)
        if self._message_text is None:
            self._message_text = self._message()
        return self._message_text

    def __repr__(self) -> str:
        if self._args_set:
            return BaseException.__repr__(self)
        return f"{type(self).__name__}({str(self)!r})"

    def _message(self) -> str:
        label, oom_killed, native_traceback = self._resolve()
        who = f"{label} {self.pid}" if self.pid is not None else f"the {label}"
        how = how_it_ended(self.exitcode, self.core_dumped, numbered=True)
        if self.lost_bytes:
            if self.expected_bytes is not None:
                when = (
                    f" while a frame was being read ({self.lost_bytes:,} of "
                    f"{self.expected_bytes:,} bytes had arrived)"
                )
            else:
                when = f" while a frame was being read ({self.lost_bytes:,} bytes had arrived)"
        else:
            when = " before writing another frame"
        msg = f"{who} {how}{when}"
        if oom_killed:
            msg += "; likely killed by the OOM killer (the cgroup's oom_kill counter rose)"
        if native_traceback:
            msg += "\n\nNative traceback of the worker:\n" + native_traceback.rstrip()
        return msg

    def __reduce__(self) -> tuple[Any, ...]:
        label, oom_killed, native_traceback = self._resolve()
        kwargs = dict(
            core_dumped=self.core_dumped,
            lost_bytes=self.lost_bytes,
            expected_bytes=self.expected_bytes,
            oom_killed=oom_killed,
            native_traceback=native_traceback,
            label=label,
        )
        state: dict[str, object] = {}
        if self._args_set:
            state["args"] = self.args
        notes = getattr(self, "__notes__", None)
        if notes is not None:
            state["__notes__"] = list(notes)
        return (_rebuild_writer_died, (type(self), self.pid, self.exitcode, kwargs), state)


def _rebuild_writer_died(cls, pid, exitcode, kwargs):  # type: ignore[no-untyped-def]
    return cls(pid, exitcode, **kwargs)


class RemoteBaseException(FramepipeError):
    """The writer sent a ``BaseException`` that is not an ``Exception`` (``SystemExit``,
    ``KeyboardInterrupt``, ``GeneratorExit``, ...) in an error frame.

    Raised as itself in the reader, such an exception would end the reader's program or pass
    for its own Ctrl-C, so a read raises this instead, an ``Exception``. ``original`` is the
    revived exception, intact (its class, args, traceback frames and cause chain), and is also
    the ``__cause__``; ``remote_type`` names its class (``"SystemExit"``), ``remote_args`` are
    its args and ``remote_traceback`` is the sender's formatted traceback. Re-raise
    ``original`` to act on it as the writer meant: ``raise err.original``.
    """

    def __init__(self, original: BaseException, remote_type: str, remote_traceback: str) -> None:
        self.original = original
        self.remote_type = remote_type
        self.remote_args: tuple[object, ...] = tuple(getattr(original, "args", ()))
        self.remote_traceback = remote_traceback
        shown = ", ".join(_short_repr(a) for a in self.remote_args)
        super().__init__(
            f"the writer sent {remote_type}({shown}), which is not an Exception: it arrives "
            "wrapped so that it cannot end this process or pass for its own Ctrl-C; the "
            "original is .original (and the cause), to re-raise if that is what you want"
        )
        self.__cause__ = original

    def __reduce__(self) -> tuple[type[RemoteBaseException], tuple[BaseException, str, str]]:
        return (type(self), (self.original, self.remote_type, self.remote_traceback))


def _short_repr(value: object) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a message never fails
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 200 else text[:197] + "..."
