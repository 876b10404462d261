"""The functions the misuse samples send to workers."""


def square(x: int) -> int:
    return x * x


def add(x: int, y: int) -> int:
    return x + y


def pairs(items: list[int]) -> tuple[int, ...]:
    return tuple(items)
