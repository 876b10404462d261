from framepipe.workers import Pool

Pool("4")  # E: arg-type
