from _tasks import square

from framepipe.workers import Worker

with Worker() as w:
    w.call(square, "x")  # E: call-overload
