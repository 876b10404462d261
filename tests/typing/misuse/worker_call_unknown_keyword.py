from _tasks import square

from framepipe.workers import Worker

with Worker() as w:
    w.call(square, 1, base=2)  # E: call-arg
