"""poll and the reads take their timeout in seconds, a number or None."""

from framepipe.connection import Pipe

a, b = Pipe()
a.poll("soon")  # E: arg-type
a.recv_bytes(timeout="5")  # E: arg-type
a.recv(timeout=[1.0])  # E: arg-type
ready: str = a.poll()  # E: assignment
