"""Verification: every chunk of a checkpoint's chain read back and checked (size, CRC32C and SHA-256).

A verification reports every defect it finds instead of stopping at the first, and reads each chunk once
per call however many chains share it; gc verifies the checkpoints its retention would keep with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from psguard.codec.strict_json import JsonFields, fields_json
from psguard.errors import CheckpointError, CorruptCheckpointError, NoCheckpointError, UnsupportedFormatError
from psguard.store.chunks import ChunkReader
from psguard.store.index import Index, full_start
from psguard.store.manifest import ChunkRef, Manifest


@dataclass(frozen=True)
class Problem(JsonFields):
    checkpoint: str
    chunk: str | None
    message: str


@dataclass(frozen=True)
class VerifyReport:
    checkpoint: str
    chain: tuple[str, ...]
    chunks_checked: int
    bytes_checked: int
    problems: tuple[Problem, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return fields_json(self, ok=self.ok)


def verify_all(index: Index, pool: ThreadPoolExecutor, checkpoint_ids: Sequence[str]) -> Iterator[VerifyReport]:
    """:meth:`psguard.store.Store.verify_all` (documented there for its callers): one ``chunk_results`` for all."""
    chunk_results: dict[str, str | None] = {}
    for cid in checkpoint_ids:
        yield verify_checkpoint(index, pool, cid, chunk_results)


def chain_bytes(index: Index, checkpoint_ids: Sequence[str]) -> int:
    """The bytes of the distinct chunks the chains of ``checkpoint_ids`` reference (manifests only; a chain
    that cannot be read counts 0): what reading them all once costs."""
    sizes: dict[str, int] = {}
    for cid in checkpoint_ids:
        with contextlib.suppress(CheckpointError):
            sizes.update((ref.hash, ref.size) for m in index.chain(cid) for ref in m.refs())
    return sum(sizes.values())


def verify_checkpoint(
    index: Index, pool: ThreadPoolExecutor, checkpoint_id: str, chunk_results: dict[str, str | None] | None = None
) -> VerifyReport:
    """Read and check every chunk of ``checkpoint_id``'s chain (:meth:`psguard.store.Store.verify`), each chunk
    once across calls sharing ``chunk_results`` (hash -> problem): gc verifying a chain's members stays linear."""
    problems: list[Problem] = []
    try:
        chain = index.chain(checkpoint_id)
    except (CorruptCheckpointError, UnsupportedFormatError, NoCheckpointError) as e:
        return VerifyReport(checkpoint_id, (), 0, 0, (Problem(e.checkpoint or checkpoint_id, None, str(e)),))
    for name in chain[-1].tensors:  # what a restore would refuse before reading anything
        try:
            full_start(chain, name)
        except CorruptCheckpointError as e:
            problems.append(Problem(checkpoint_id, None, str(e)))
    cache: dict[str, str | None] = chunk_results if chunk_results is not None else {}
    seen: set[str] = set()
    futures: list[tuple[Manifest, ChunkRef, Future[Any] | None]] = []
    for m in chain:
        reader = ChunkReader(index.backend, checkpoint=m.id, verify_hash=True)
        for ref in m.refs():
            if ref.hash in seen:
                continue
            seen.add(ref.hash)
            futures.append((m, ref, None if ref.hash in cache else pool.submit(reader.verify, ref)))
    nbytes = 0
    for m, ref, fut in futures:
        if fut is not None:
            try:
                fut.result()
                cache[ref.hash] = None
            except CorruptCheckpointError as e:
                cache[ref.hash] = str(e)
        message = cache[ref.hash]
        if message is None:
            nbytes += ref.size
        else:
            problems.append(Problem(m.id, ref.hash, message))
    return VerifyReport(checkpoint_id, tuple(m.id for m in chain), len(futures), nbytes, tuple(problems))
