"""Copying one checkpoint and the chain it needs from one store to another, across backends, verified.

The copy follows the store's commit protocol at the destination: under a writer lease, every chunk is read from
the source with its SHA-256 and CRC32C checked and written, and only then each manifest, create-only, base first
(a manifest or chunk already there is kept: ids and chunks are unique). The destination then verifies the chain;
a damaged chunk found there is written again once from the source, and verified again.
"""

from __future__ import annotations

from dataclasses import dataclass

from psguard.codec.strict_json import JsonFields
from psguard.errors import CorruptCheckpointError, ObjectExistsError
from psguard.store.chunks import ChunkReader
from psguard.store.facade import Store
from psguard.store.lease import acquire_writer_lease
from psguard.store.manifest import Manifest, chunk_key, manifest_key
from psguard.store.verify import VerifyReport


@dataclass(frozen=True)
class CopyReport(JsonFields):
    checkpoint: str
    chain: tuple[str, ...]
    manifests_copied: int
    chunks_copied: int
    bytes_copied: int
    verified: VerifyReport


def _copy_chunks(src: Store, dst: Store, m: Manifest, only: set[str] | None = None) -> tuple[int, int]:
    reader = ChunkReader(src.backend, checkpoint=m.id, verify_hash=True)
    count = nbytes = 0
    for ref in {r.hash: r for r in m.refs()}.values():
        key = chunk_key(ref.hash)
        if only is not None and ref.hash not in only:
            continue
        if only is None and dst.backend.exists(key):
            continue
        data = reader.read(ref)  # raises CorruptCheckpointError when the source's copy is damaged
        dst.backend.put(key, data)
        count += 1
        nbytes += len(data)
    return count, nbytes


def copy_checkpoint(src: Store, dst: Store, checkpoint_id: str) -> CopyReport:
    """Copy ``checkpoint_id`` and its chain from ``src`` to ``dst``; the destination's verification of it."""
    chain = src.chain(checkpoint_id)
    # a gc at the destination keeps our chunks
    lease, keeper = acquire_writer_lease(dst.backend, checkpoint_id, None, dst.lock_ttl)
    manifests = chunks = nbytes = 0
    try:
        for m in chain:
            c, n = _copy_chunks(src, dst, m)
            chunks, nbytes = chunks + c, nbytes + n
            key = manifest_key(m.id)
            if dst.backend.exists(key):
                continue
            try:
                keeper.confirm()  # still our lease: a gc at the destination cannot have taken the chunks
                dst.backend.put_new(key, src.backend.get(key))  # the commit, after every chunk it names
                manifests += 1
            except ObjectExistsError:
                pass  # another copy committed it meanwhile: the same checkpoint
        report = dst.verify(checkpoint_id)
        if not report.ok:
            damaged = {p.chunk for p in report.problems if p.chunk}
            for m in chain:
                c, n = _copy_chunks(src, dst, m, only=damaged)
                chunks, nbytes = chunks + c, nbytes + n
            report = dst.verify(checkpoint_id)
    finally:
        keeper.stop()
        lease.release()
    if not report.ok:
        raise CorruptCheckpointError(
            f"copy of {checkpoint_id} to {dst.url} does not verify there: "
            + "; ".join(p.message for p in report.problems[:3]),
            checkpoint=checkpoint_id,
        )
    return CopyReport(checkpoint_id, tuple(m.id for m in chain), manifests, chunks, nbytes, report)
