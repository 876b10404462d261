"""wait() returns the objects it was given, with their type."""

from framepipe.connection import Connection, Pipe, wait

a, b = Pipe()
ready: list[int] = wait([a, b], timeout=0.0)  # E: list-item
first: Connection = wait([a, b])[0]
fds: list[str] = wait([3, 4])  # E: assignment
wait([a], timeout="never")  # E: arg-type
wait(["not a connection"])  # E: type-var
