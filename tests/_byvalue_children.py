"""Helpers for test_byvalue: module level, so that a spawned worker imports them."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

REDUCED = 0  # times a Counted was pickled in this process


def _counted_load(path: str, k: int) -> Counted:
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")
    return Counted(path, k)


class Counted:
    """Pickling it counts here; unpickling it writes the unpickling process's pid to ``path``."""

    def __init__(self, path: str, k: int) -> None:
        self.path = path
        self.k = k

    def __reduce__(self) -> tuple[Any, ...]:
        global REDUCED
        REDUCED += 1
        return _counted_load, (self.path, self.k)


def make_closure(counted: Counted) -> Callable[[int], int]:
    def add_k(x: int) -> int:
        return x + counted.k

    return add_k


def call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def make_adder(k: int) -> Callable[[int], int]:
    return lambda x: x + k


def pid_of_worker(_: Any = None) -> int:
    return os.getpid()


class Mapped:
    """A dataset of ``fn(i)`` for i < n."""

    def __init__(self, n: int, fn: Callable[[int], Any]) -> None:
        self.n = n
        self.fn = fn

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.fn(i)
