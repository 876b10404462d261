"""Client() and Listener.accept() return a Connection, typed as Pipe()'s are."""

from framepipe.connection import Client, Listener

with Listener() as listener:
    conn = Client(listener.address)
    conn.send_bytes(42)  # E: arg-type
    server = listener.accept()
    n: int = server.recv_bytes()  # E: assignment
    server.poll("now")  # E: arg-type
    server.no_such_method()  # E: attr-defined
