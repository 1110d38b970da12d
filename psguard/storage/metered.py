"""A backend wrapper that reports the bytes read through it: the figure the CLI's progress shows."""

from __future__ import annotations

from collections.abc import Callable

from psguard.storage.base import Backend, Buffer

__all__ = ["MeteredBackend"]


class MeteredBackend(Backend):
    """``inner`` with ``on_read(nbytes)`` called after every object read (from the reading thread)."""

    def __init__(self, inner: Backend, on_read: Callable[[int], None]) -> None:
        self.inner = inner
        self.on_read = on_read
        self.url = inner.url
        self.io_parallelism = inner.io_parallelism
        self.mtime_resolution = inner.mtime_resolution

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        self.on_read(len(data))
        return data

    def get_into(self, key: str, out: memoryview) -> int:
        size = self.inner.get_into(key, out)
        self.on_read(min(size, len(out)))
        return size

    def put(self, key: str, data: Buffer) -> None:
        self.inner.put(key, data)

    def put_new(self, key: str, data: Buffer) -> None:
        self.inner.put_new(key, data)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def keys(self, prefix: str) -> list[str]:
        return self.inner.keys(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def mtime(self, key: str) -> float:
        return self.inner.mtime(key)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def mtimes(self, prefix: str) -> dict[str, float]:
        return self.inner.mtimes(prefix)

    def leftovers(self) -> list[str]:
        return self.inner.leftovers()

    def close(self) -> None:
        self.inner.close()

    def explain(self, error: BaseException) -> str | None:
        return self.inner.explain(error)
