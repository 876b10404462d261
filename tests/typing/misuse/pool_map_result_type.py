from _tasks import add

from framepipe.workers import Pool

with Pool(1) as pool:
    for total in pool.map(add, [1], [2]):
        text: str = total  # E: assignment
