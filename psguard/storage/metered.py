"""A backend wrapper that reports the bytes read through it: the figure the CLI's progress shows."""

from __future__ import annotations

from collections.abc import Callable

from psguard.storage.base import Backend, Wrapper


class MeteredBackend(Wrapper):
    """``inner`` with ``on_read(nbytes)`` called after every object read (from the reading thread)."""

    def __init__(self, inner: Backend, on_read: Callable[[int], None]) -> None:
        super().__init__(inner)
        self.on_read = on_read

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        self.on_read(len(data))
        return data

    def get_into(self, key: str, out: memoryview) -> int:
        size = self.inner.get_into(key, out)
        self.on_read(min(size, len(out)))
        return size
