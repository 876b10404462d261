from _tasks import square

from framepipe.workers import Worker

with Worker() as w:
    text: str = w.call(square, 3, timeout=5.0)  # E: assignment
