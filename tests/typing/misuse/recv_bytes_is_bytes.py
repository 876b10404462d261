"""recv_bytes returns bytes and recv_bytes_into an int: neither is anything else."""

from framepipe.connection import Pipe

r, w = Pipe(duplex=False)
x: int = r.recv_bytes()  # E: assignment
text: str = r.recv_bytes(timeout=1.0)  # E: assignment
size: bytes = r.recv_bytes_into(bytearray(8))  # E: assignment
r.recv_bytes_into("not a buffer")  # E: arg-type
