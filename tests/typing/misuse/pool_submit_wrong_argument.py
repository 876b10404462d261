from _tasks import square

from framepipe.workers import Pool

with Pool(1) as pool:
    pool.submit(square, "x")  # E: arg-type
