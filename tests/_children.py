"""Code that runs in child processes during the tests.

multiprocessing pickles a target by reference, so the functions live in a module a spawned or
forkserver child can import: pytest puts this directory on ``sys.path`` (the tests are not a
package) and multiprocessing hands the parent's ``sys.path`` to its children.

Run as a script, it is the child of the ``subprocess`` tests:
``python _children.py IMPL ROLE FD [ARG]`` where IMPL is ``c`` or ``python``.
"""

from __future__ import annotations

import random
import sys

# Every blocking read in a child has a deadline, so a broken parent cannot leave it hanging.
READ_TIMEOUT = 60.0


def pattern(n: int, seed: int = 0) -> bytes:
    """``n`` reproducible pseudo-random bytes."""
    return random.Random(n * 1_000_003 + seed).randbytes(n)


def serve(conn) -> None:
    """Answer requests until ``None`` arrives or the parent goes away.

    ``("bytes", n)``: send ``pattern(n)`` with send_bytes; ``("array", n)``: send a NumPy array
    of ``n`` uint8 (out-of-band buffer when large); ``"module"``: send the module that defines
    this connection's class; ``"echo-bytes"``: receive one message with recv_bytes and send it
    back with send_bytes; anything else is sent back with send().
    """
    with conn:
        while True:
            try:
                request = conn.recv(timeout=READ_TIMEOUT)
            except EOFError:
                return
            if request is None:
                return
            if isinstance(request, tuple) and request[:1] == ("bytes",):
                conn.send_bytes(pattern(request[1]))
            elif isinstance(request, tuple) and request[:1] == ("array",):
                import numpy as np

                conn.send(np.frombuffer(pattern(request[1]), dtype=np.uint8).copy())
            elif request == "module":
                conn.send(conn.ENGINE)
            elif request == "echo-bytes":
                conn.send_bytes(conn.recv_bytes(timeout=READ_TIMEOUT))
            else:
                conn.send(request)


def send_frames_and_exit(conn, sizes) -> None:
    """Send ``pattern(n)`` for each n in ``sizes``, then exit (closing the connection)."""
    with conn:
        for n in sizes:
            conn.send_bytes(pattern(n))


def _main(argv: list[str]) -> int:
    impl_name, role, fd = argv[0], argv[1], int(argv[2])
    from framepipe import _impl

    core = _impl.load(impl_name)
    if role == "serve":
        # FD alone (a socket), or FD and the fd to write to (two pipes)
        write_fd = int(argv[3]) if len(argv) > 3 else None
        serve(core.Connection(fd, write_handle=write_fd))
        return 0
    if role == "frames":
        sizes = [int(s) for s in argv[3].split(",")]
        send_frames_and_exit(core.Connection(fd, readable=False), sizes)
        return 0
    if role == "read-one":
        # Read one message, report it on stdout, exit: the parent then writes to a pipe
        # whose only reader is gone.
        with core.Connection(fd, writable=False) as conn:
            data = conn.recv_bytes(timeout=READ_TIMEOUT)
        print(len(data), flush=True)
        return 0
    if role == "write-until-broken":
        # Wait for the parent's go (a line on stdin: by then it has closed the read end),
        # then write until the pipe is found broken.
        conn = core.Connection(fd, readable=False)
        sys.stdin.readline()
        try:
            for _ in range(1000):
                conn.send_bytes(b"x" * 70_000)
        except BrokenPipeError as exc:
            print("BrokenPipeError", exc.errno, flush=True)
            conn.close()
            return 0
        print("no error", flush=True)
        return 1
    raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
