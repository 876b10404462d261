from _tasks import square

from framepipe.workers import Pool

with Pool(1) as pool:
    pool.map(square, ["a", "b"])  # E: arg-type
