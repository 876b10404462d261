from _tasks import add

from framepipe.workers import Pool

with Pool(1) as pool:
    pool.submit(add, 1)  # E: call-arg
