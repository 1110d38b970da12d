"""Shared code for backends that talk to a remote filesystem through fsspec."""

from __future__ import annotations

import contextlib
import secrets
from typing import Any

from psguard.errors import ObjectNotFoundError
from psguard.storage.base import Backend, validate_key

TMP_MARK = ".tmp."


class FsspecBackend(Backend):
    """Objects are files under ``root`` of an fsspec filesystem ``fs``.

    Subclasses decide how to make ``put``/``put_new`` atomic on their system.
    """

    fs: Any
    root: str

    def _p(self, key: str) -> str:
        return f"{self.root}/{validate_key(key)}"

    def _tmp_name(self, key: str) -> str:
        return f"{self._p(key)}{TMP_MARK}{secrets.token_hex(6)}"

    def get(self, key: str) -> bytes:
        try:
            data = self.fs.cat_file(self._p(key))
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{key} not found in {self.url}") from None
        return bytes(data)

    def exists(self, key: str) -> bool:
        return bool(self.fs.exists(self._p(key)))

    def _files(self, base: str) -> list[str]:
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return []
        # Some servers list an emptied "folder" as an entry of its own: only files are objects.
        return [name for name, info in found.items() if info.get("type") == "file"]

    def keys(self, prefix: str) -> list[str]:
        found = self._files(f"{self.root}/{prefix}".rstrip("/"))
        strip = self.root.strip("/") + "/"
        keys = []
        for path in found:
            rel = path.strip("/")
            if rel.startswith(strip):
                rel = rel[len(strip) :]
            if TMP_MARK in rel.rsplit("/", 1)[-1]:
                continue
            keys.append(rel)
        keys.sort()
        return keys

    def leftovers(self) -> list[str]:
        found = self._files(self.root)
        strip = self.root.strip("/") + "/"
        return sorted(
            p.strip("/")[len(strip) :]
            for p in found
            if TMP_MARK in p.rsplit("/", 1)[-1] and p.strip("/").startswith(strip)
        )

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._p(key))
