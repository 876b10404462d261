from _tasks import square

from framepipe.workers import Pool

with Pool(1) as pool:
    text: str = pool.submit(square, 2).result()  # E: assignment
