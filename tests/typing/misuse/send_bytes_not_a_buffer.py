"""send_bytes takes a bytes-like object: an int or a str is refused."""

from framepipe.connection import Pipe

a, b = Pipe()
a.send_bytes(123)  # E: arg-type
a.send_bytes("text")  # E: arg-type
a.send_bytes(b"ok", "0")  # E: arg-type
