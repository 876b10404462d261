"""``Closing``: the context manager and finalizer of an object that owns something to close."""

from __future__ import annotations

from typing import TypeVar

__all__ = ["Closing"]

_T = TypeVar("_T", bound="Closing")


class Closing:
    """``with obj:`` closes it on leaving the block, and so does dropping it; a subclass
    defines ``close()``, which must be safe to call more than once."""

    __slots__ = ()

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a finalizer never raises
            pass
