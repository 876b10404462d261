"""Who is compared: framepipe's cores, the stdlib's ``multiprocessing.connection``, pyzmq, and
the optional libraries other suites compare against (numpy, torch, loky, pebble, mpire) or
draw with (matplotlib), with what to install when one is missing.

An :class:`Impl` makes connections with the ``multiprocessing.connection`` API: ``oneway()``
gives ``(reader, writer)``, ``duplex()`` gives ``(parent end, child end)``. The ends are made in
this process before the writer is forked; pyzmq's sockets open on first use, so each process
opens its own.
"""

from __future__ import annotations

import importlib
import itertools
import multiprocessing
import os
import pickle
import stat
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .. import _impl
from .rows import STDLIB_DUPLEX, STDLIB_SIMPLEX

__all__ = [
    "EXTRA_HINT",
    "IMPL_CHOICES",
    "OPTIONAL",
    "Duo",
    "Impl",
    "OptionalPeer",
    "ZmqEnd",
    "framepipe_impl",
    "implementations",
    "missing",
    "missing_line",
    "missing_line_for",
    "stdlib_impls",
    "versions",
    "zmq_impl",
]

EXTRA_HINT = "pip install 'framepipe[bench]'"


@dataclass(frozen=True)
class OptionalPeer:
    """A library a suite compares against (or draws with) when it is installed."""

    module: str
    """What is imported."""
    package: str
    """What ``pip install`` takes."""
    used_for: str
    """Which rows need it."""
    suites: tuple[str, ...]


OPTIONAL = [
    OptionalPeer(
        "numpy",
        "numpy",
        "numpy array rows, result arrays, the loader",
        ("core", "workers", "loader"),
    ),
    OptionalPeer("zmq", "pyzmq", "pyzmq PAIR sockets beside the stdlib", ("core",)),
    OptionalPeer("torch", "torch", "torch's DataLoader", ("loader",)),
    OptionalPeer("loky", "loky", "loky's executor", ("workers",)),
    OptionalPeer("pebble", "pebble", "pebble's ProcessPool", ("workers",)),
    OptionalPeer("mpire", "mpire", "mpire's WorkerPool", ("workers",)),
    OptionalPeer("matplotlib", "matplotlib", "--plot", ("core", "workers", "loader")),
]


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def missing(suite: str) -> list[OptionalPeer]:
    """The optional peers of ``suite`` that do not import here."""
    return [p for p in OPTIONAL if suite in p.suites and not _importable(p.module)]


def missing_line(suite: str, *, plot: bool = False) -> str | None:
    """One line naming the missing optional peers of ``suite`` and how to add them; None when
    nothing is missing. matplotlib counts only when a plot was asked for."""
    return missing_line_for([p for p in missing(suite) if plot or p.module != "matplotlib"])


def missing_line_for(gone: Sequence[OptionalPeer]) -> str | None:
    """One line naming the peers ``gone`` and how to add them; None when there is none."""
    if not gone:
        return None
    names = ", ".join(f"{p.package} ({p.used_for})" for p in gone)
    return (
        f"not installed, so left out: {names}; add the optional peers with {EXTRA_HINT} "
        f"(or pip install {' '.join(p.package for p in gone)})"
    )


def versions(suite: str) -> dict[str, str | None]:
    """The version of each optional peer of ``suite`` (None when it is missing)."""
    out: dict[str, str | None] = {}
    for peer in OPTIONAL:
        if suite not in peer.suites:
            continue
        try:
            mod = importlib.import_module(peer.module)
        except ImportError:
            out[peer.package] = None
            continue
        version = getattr(mod, "__version__", None)
        if version is None:
            try:
                from importlib.metadata import version as dist_version

                version = dist_version(peer.package)
            except Exception:  # noqa: BLE001 - a version is a label only
                version = "unknown"
        out[peer.package] = str(version)
    return out


# -- connections -------------------------------------------------------------------------------


class Duo:
    """Two one-way connections used as one duplex end: reads from ``reader``, writes to
    ``writer``. The methods are the underlying bound methods, so a loop that binds
    ``end.recv_bytes`` pays nothing for the pairing."""

    def __init__(self, reader: Any, writer: Any) -> None:
        self.reader, self.writer = reader, writer
        self.recv_bytes = reader.recv_bytes
        self.recv = reader.recv
        self.poll = reader.poll
        self.send_bytes = writer.send_bytes
        self.send = writer.send

    def close(self) -> None:
        """Close both connections."""
        self.reader.close()
        self.writer.close()


@dataclass(frozen=True)
class Impl:
    """One implementation under test: how to make its connections.

    ``module`` is the framepipe core module (None for the others).
    """

    name: str
    family: str
    oneway: Callable[[], tuple[Any, Any]]
    duplex: Callable[[], tuple[Any, Any]]
    module: Any = None
    description: str = ""
    timed_read: bool = False
    """Whether ``recv_bytes(timeout=...)`` exists (otherwise ``poll(t)`` + ``recv_bytes()``)."""

    @property
    def is_framepipe(self) -> bool:
        """True for framepipe's own cores."""
        return self.family == "framepipe"


def _stdlib_simplex_duplex() -> tuple[Any, Any]:
    down_r, down_w = multiprocessing.Pipe(duplex=False)
    up_r, up_w = multiprocessing.Pipe(duplex=False)
    return Duo(up_r, down_w), Duo(down_r, up_w)


def stdlib_impls() -> list[Impl]:
    """The two ``multiprocessing.connection`` baselines."""
    return [
        Impl(
            STDLIB_DUPLEX,
            "stdlib",
            lambda: multiprocessing.Pipe(duplex=True),
            lambda: multiprocessing.Pipe(duplex=True),
            description="multiprocessing.Pipe(): a socketpair",
        ),
        Impl(
            STDLIB_SIMPLEX,
            "stdlib",
            lambda: multiprocessing.Pipe(duplex=False),
            _stdlib_simplex_duplex,
            description="multiprocessing.Pipe(duplex=False): an os.pipe (two for round trips)",
        ),
    ]


def _pipe_function(module: Any) -> Callable[..., tuple[Any, Any]]:
    """How a core module makes a connected pair (the one place that knows)."""
    pipe = getattr(module, "pipe", None)
    if pipe is None:
        raise ImportError(f"{module.__name__} has no pipe(); the benchmark cannot make its pipes")
    return pipe  # type: ignore[no-any-return]


def _transport(pipe: Callable[..., tuple[Any, Any]], **kwargs: Any) -> str:
    """What ``pipe(**kwargs)`` is made of: ``os.pipe``, ``socketpair`` or ``seqpacket
    socketpair`` (records, see ``framepipe._wire.RECORD_MAX``)."""
    a, b = pipe(**kwargs)
    try:
        if not stat.S_ISSOCK(os.fstat(a.fileno()).st_mode):
            return "os.pipe"
        return "seqpacket socketpair" if a._records else "socketpair"
    finally:
        a.close()
        b.close()


def framepipe_impl(name: str, *, read_ahead: bool = False, pipes: bool = False) -> Impl:
    """framepipe's core ``name`` (``"c"`` or ``"python"``) with its default settings; raises
    ImportError when it is not available here. ``read_ahead`` makes the ``<name> read-ahead``
    variant, ``pipes`` the ``<name> pipes`` one (a duplex connection over two one-way pipes)."""
    module = _impl.load(name)
    pipe = _pipe_function(module)
    label = name + (" read-ahead" if read_ahead else "") + (" pipes" if pipes else "")
    duplex_kwargs: dict[str, Any] = {"duplex": True, "read_ahead": read_ahead}
    if pipes:
        duplex_kwargs["pipes"] = True
    what = "compiled core" if name == "c" else "pure-Python core"
    return Impl(
        label,
        "framepipe",
        lambda: pipe(duplex=False, read_ahead=read_ahead),
        lambda: pipe(**duplex_kwargs),
        module=module,
        description=f"framepipe's {what}, Pipe(duplex=False): "
        f"{_transport(pipe, duplex=False)}; Pipe(): {_transport(pipe, **duplex_kwargs)}"
        + ("; read_ahead=True" if read_ahead else "")
        + ("; pipes=True" if pipes else ""),
        timed_read=True,
    )


# -- pyzmq --------------------------------------------------------------------------------------

ZMQ_COPY_BELOW = 64 * 1024
"""pyzmq copies a message smaller than this (its own advice for small messages) and sends or
receives a larger one without a copy (``copy=False``)."""

ZMQ_READ_LIMIT = 30.0
"""Seconds a pyzmq reader in this process waits for a message before TimeoutError: zmq has no end
of file, so a writer that died would otherwise leave it waiting forever."""

_addresses = itertools.count()


class ZmqEnd:
    """One end of a pyzmq PAIR connection over ``ipc://`` with the ``send_bytes``/
    ``recv_bytes``/``send``/``recv`` calls the benchmark uses. The socket (and a context of its own)
    opens on first use, in the process that uses it: zmq contexts do not survive a fork."""

    def __init__(self, address: str, *, bind: bool) -> None:
        self.address, self.bind = address, bind
        self._socket: Any = None
        self._context: Any = None
        self._copy = True
        self._timeout: float | None = None
        self._pid = 0

    def _open(self) -> Any:
        import zmq

        self._context = zmq.Context()
        sock = self._context.socket(zmq.PAIR)
        # A reader never waits forever, since zmq has no end of file to tell it that its
        # writer died (see close() for how a writer's last messages are kept).
        self._timeout = None if not self.bind else ZMQ_READ_LIMIT
        sock.setsockopt(zmq.RCVTIMEO, -1 if self._timeout is None else int(self._timeout * 1000))
        if self.bind:
            sock.bind(self.address)
        else:
            sock.connect(self.address)
        self._socket, self._pid = sock, os.getpid()
        return sock

    def send_bytes(self, buf: Any) -> None:
        """Send one message (the first call opens the socket)."""
        sock = self._socket if self._socket is not None else self._open()
        sock.send(buf, copy=len(buf) < ZMQ_COPY_BELOW)

    def recv_bytes(self, timeout: float | None = None) -> Any:
        """Receive one message: bytes when small, a zero-copy zmq Frame when large (the
        receiving mode follows the size of the previous message). ``timeout`` (seconds) sets
        the socket's receive timeout (``RCVTIMEO``, zmq's own way); TimeoutError when it
        expires."""
        sock = self._socket if self._socket is not None else self._open()
        if timeout is None and self.bind:
            timeout = ZMQ_READ_LIMIT
        if timeout != self._timeout:
            import zmq

            sock.setsockopt(zmq.RCVTIMEO, -1 if timeout is None else int(timeout * 1000))
            self._timeout = timeout
        got = self._timed(sock.recv, copy=self._copy)
        self._copy = len(got) < ZMQ_COPY_BELOW
        return got

    def _timed(self, call: Callable[..., Any], **kwargs: Any) -> Any:
        """``call(**kwargs)``, its zmq.Again (the receive timeout expired) a TimeoutError."""
        try:
            return call(**kwargs)
        except Exception as exc:
            if type(exc).__name__ == "Again":
                raise TimeoutError(f"no message within {self._timeout:g} s") from None
            raise

    def send(self, obj: Any) -> None:
        """Send a picklable object: pickle protocol 5, its large buffers as zero-copy parts of
        one multipart message (what pyzmq's documentation shows for arrays)."""
        sock = self._socket if self._socket is not None else self._open()
        buffers: list[pickle.PickleBuffer] = []
        head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
        sock.send_multipart([head, *(b.raw() for b in buffers)], copy=False)

    def recv(self) -> Any:
        """Receive an object sent by :meth:`send`."""
        sock = self._socket if self._socket is not None else self._open()
        head, *buffers = self._timed(sock.recv_multipart, copy=False)
        return pickle.loads(head.buffer, buffers=[b.buffer for b in buffers])

    def close(self) -> None:
        """Close the socket and its context (in the process that opened them).

        zmq drops the messages a reader has not yet taken when its peer disconnects, so the
        two ends agree on the end: the reader's end sends a last empty message as it closes,
        and the writer's end waits for it (up to :data:`ZMQ_READ_LIMIT`) before closing."""
        if self._socket is None or self._pid != os.getpid():
            return
        sock = self._socket
        try:
            if self.bind:
                sock.send(b"", flags=_zmq_noblock())
            else:
                self._timeout = ZMQ_READ_LIMIT
                sock.setsockopt(_zmq_rcvtimeo(), int(ZMQ_READ_LIMIT * 1000))
                while len(self._timed(sock.recv)) != 0:
                    pass  # an answer still in flight (a round trip's writer)
        except Exception:  # noqa: BLE001 - the other end is gone: nothing is left to deliver
            pass
        finally:
            sock.close(linger=1000 if self.bind else 0)  # the last message goes out
            self._context.term()
            self._socket = None
        if self.bind and self.address.startswith("ipc://"):
            try:
                os.unlink(self.address[len("ipc://") :])
            except OSError:
                pass


def _zmq_noblock() -> int:
    import zmq

    return int(zmq.NOBLOCK)


def _zmq_rcvtimeo() -> int:
    import zmq

    return int(zmq.RCVTIMEO)


def _zmq_pair() -> tuple[ZmqEnd, ZmqEnd]:
    path = os.path.join(
        tempfile.gettempdir(), f"framepipe-bench-{os.getpid()}-{next(_addresses)}.ipc"
    )
    return ZmqEnd(f"ipc://{path}", bind=True), ZmqEnd(f"ipc://{path}", bind=False)


def zmq_impl() -> Impl:
    """pyzmq's PAIR sockets over ``ipc://``; ImportError when pyzmq is not installed."""
    import zmq

    return Impl(
        "pyzmq",
        "other",
        _zmq_pair,
        _zmq_pair,
        description=f"pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}): PAIR sockets over "
        f"ipc://, zero-copy from {ZMQ_COPY_BELOW // 1024} KiB; timed reads with RCVTIMEO",
        timed_read=True,
    )


IMPL_CHOICES = ("c", "c-read-ahead", "c-pipes", "python", "pyzmq")
"""What ``--impls`` names (the stdlib always runs: it is what the ratios are against)."""


def implementations(names: Sequence[str]) -> tuple[list[Impl], list[str]]:
    """The implementations ``names`` (see :data:`IMPL_CHOICES`) that work here, then the
    stdlib's, and a note for each that was asked for and does not work (pyzmq's missing
    module is left to :func:`missing_line`)."""
    impls: list[Impl] = []
    notes: list[str] = []
    for name in names:
        try:
            if name == "pyzmq":
                impls.append(zmq_impl())
                continue
            core, _, variant = name.partition("-")
            impls.append(
                framepipe_impl(core, read_ahead=variant == "read-ahead", pipes=variant == "pipes")
            )
        except ImportError as exc:
            if name != "pyzmq":
                notes.append(f"framepipe {name!r} skipped: {type(exc).__name__}: {exc}")
    impls.extend(stdlib_impls())
    return impls, notes
