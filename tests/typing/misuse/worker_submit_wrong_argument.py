from _tasks import add

from framepipe.workers import Worker

with Worker() as w:
    w.submit(add, 1, None)  # E: arg-type
