"""framepipe.Pipe (the reference-style one-way pipe) reads and writes bytes."""

import framepipe

pipe = framepipe.Pipe()
pipe.write(12)  # E: arg-type
count: int = pipe.read()  # E: assignment
pipe.read(timeout="later")  # E: arg-type
