from _tasks import square

from framepipe.workers import Pool


async def main(pool: Pool) -> None:
    await pool.acall(square, b"x")  # E: arg-type
