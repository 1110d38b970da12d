"""The durable log's paths, as workloads: a save (full and delta), compaction, gc, retention, leases, the journal.

Each workload prepares what its path starts from (earlier commits, unrecorded but acknowledged in the history),
begins recording, and runs the path through the store's public facade and :class:`DurableWriter`, as the
trainer's writer and the chief's persister do. The data is a function of the seed and the step (:func:`state`),
so the checker knows what every checkpoint must restore to, bit for bit.

History vocabulary (the invoke's value, then the ok's): ``steps`` the steps the operation may commit and ``new``
how many checkpoints at most; ``keep_last`` for an operation that may delete checkpoints (gc, retention);
``commits`` (``[[id, step], ...]``) what the operation committed, acknowledged once ``ok`` is written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from psguard.store import CheckpointInfo, Store
from psguard.store.durable import ChainState, DurableWriter
from psguard.store.lease import acquire_gc_lease, acquire_writer_lease
from psguard.store.manifest import new_checkpoint_id
from psguard.tensors import Full, Rows, Same, TensorUpdate
from psguard.testbed.crash.session import Session

__all__ = ["STORE_PATHS", "delta", "state"]

ROWS, WIDTH, CHANGED = 48, 4, 5
#: Lease TTL of the workloads: no refresh thread fires during a run, so calls come in the same order every time.
LOCK_TTL = 600.0


def _change(seed: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, step])
    ids = np.sort(rng.choice(ROWS, size=CHANGED, replace=False)).astype(np.int64)
    return ids, rng.standard_normal((CHANGED, WIDTH)).astype(np.float32)


def state(seed: int, step: int) -> dict[str, np.ndarray]:
    """The model at ``step`` (1: the first base; each later step changes a few rows of ``emb``)."""
    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
    bias = rng.standard_normal(8).astype(np.float32)
    for k in range(2, step + 1):
        ids, rows = _change(seed, k)
        emb[ids] = rows
    return {"emb": emb, "bias": bias, "count": np.array(step, dtype=np.int64)}


def delta(seed: int, step: int) -> dict[str, TensorUpdate]:
    """What changed from ``step - 1`` to ``step``."""
    ids, rows = _change(seed, step)
    return {
        "emb": Rows(ids, rows, (ROWS, WIDTH)),
        "bias": Same((8,), np.dtype(np.float32)),
        "count": Full(np.array(step, dtype=np.int64)),
    }


def never(_: ChainState, __: int) -> bool:
    return False


def no_retention(_: CheckpointInfo) -> None:
    return None


def writer(store: Store, **kwargs: Any) -> DurableWriter:
    kwargs.setdefault("base_rule", never)
    kwargs.setdefault("retention", no_retention)
    kwargs.setdefault("compact", False)
    return DurableWriter(store, **kwargs)


def commit(session: Session, dw: DurableWriter, step: int, *, whole: bool, keep_last: int | None = None) -> None:
    """One save as the agents and the trainer make it: the commit, acknowledged; then the writer's tidying (the
    commit's journal entry, compaction, retention) as the next operation."""
    session.invoke("save", steps=[step], new=1)
    seed = session.run.seed
    updates: dict[str, TensorUpdate] = (
        {n: Full(v) for n, v in state(seed, step).items()} if whole else delta(seed, step)
    )
    info = dw.save(step, updates, whole=whole)
    session.ok("save", commits=[[info.id, info.step]])
    extra = {"keep_last": keep_last} if keep_last is not None else {}
    session.invoke("tidy", steps=[step], new=1 if dw.compact else 0, journal=info.id, **extra)
    dw.tidy(info)
    made = [[dw.last.id, dw.last.step]] if dw.last is not None and dw.last.id != info.id else []  # compacted
    session.ok("tidy", commits=made)


# ------------------------------------------------------------------------------------------------ workloads
def save_full(session: Session) -> None:
    with session.store(lock_ttl=LOCK_TTL) as store:
        session.begin()
        commit(session, writer(store), 1, whole=True)


def save_delta(session: Session) -> None:
    with session.store(lock_ttl=LOCK_TTL) as store:
        dw = writer(store)
        commit(session, dw, 1, whole=True)
        session.begin()
        commit(session, dw, 2, whole=False)


def compaction(session: Session) -> None:
    with session.store(lock_ttl=LOCK_TTL) as store:
        dw = writer(store)
        commit(session, dw, 1, whole=True)
        commit(session, dw, 2, whole=False)
        commit(session, dw, 3, whole=False)
        session.begin()
        session.invoke("compact", steps=[3], new=1)
        info = store.compact()
        assert info is not None
        session.ok("compact", commits=[[info.id, info.step]])


def gc(session: Session) -> None:
    """A gc that deletes two checkpoints and their chunks, then the next save (whose syncs may make some of the
    gc's deletions durable and not others)."""
    with session.store(lock_ttl=LOCK_TTL, chunk_grace=0) as store:
        dw = writer(store)
        commit(session, dw, 1, whole=True)
        commit(session, dw, 2, whole=False)
        commit(session, dw, 3, whole=True)
        commit(session, dw, 4, whole=False)
        session.begin()
        session.invoke("gc", keep_last=1, steps=[], new=0)
        report = store.gc(keep_last=1)
        session.ok("gc", deleted=list(report.deleted_checkpoints))
        commit(session, dw, 5, whole=False)


def retention(session: Session) -> None:
    """The trainer's writer: a delta, the chain compacted into a new base, retention keeping the last one."""
    with session.store(lock_ttl=LOCK_TTL, chunk_grace=0) as store:

        def keep_one(_: CheckpointInfo) -> dict[str, Any]:
            return {"keep_last": 1, "keep_every_hours": None}

        dw = writer(store, base_rule=lambda s, _: s.chain_length >= 1, retention=keep_one, compact=True)
        commit(session, writer(store), 1, whole=True)
        dw.adopt(store.latest())
        session.begin()
        commit(session, dw, 2, whole=False, keep_last=1)


def leases(session: Session) -> None:
    """A save's lease taken, renewed and released, then gc's; after a crash anywhere in them the next save and
    the next gc go ahead (a dead holder's lease is stale at once) and the commit before them stands."""
    with session.store(lock_ttl=LOCK_TTL) as store:
        dw = writer(store)
        commit(session, dw, 1, whole=True)
        backend = store.backend
        session.begin()
        session.invoke("writer-lease", steps=[], new=0)
        lease, keeper = acquire_writer_lease(backend, new_checkpoint_id(2), dw.last.id if dw.last else None, LOCK_TTL)
        session.ok("writer-lease")
        session.invoke("renew", steps=[], new=0)
        keeper.confirm()
        session.ok("renew")
        session.invoke("release", steps=[], new=0)
        keeper.stop()
        lease.release()
        session.ok("release")
        session.invoke("gc-lease", steps=[], new=0)
        gc_lease = acquire_gc_lease(backend, LOCK_TTL)
        gc_lease.refresh()
        gc_lease.release()
        session.ok("gc-lease")


def journal(session: Session) -> None:
    """Two writers (two store instances, as an orphaned writer and its replacement) appending to one journal:
    the second takes sequence numbers the first then finds taken."""
    with session.store(lock_ttl=LOCK_TTL) as a, session.store(lock_ttl=LOCK_TTL) as b:
        first, second = writer(a), writer(b)
        session.begin()
        commit(session, first, 1, whole=True)
        second.adopt(b.latest())
        commit(session, second, 2, whole=False)
        first.adopt(a.latest())
        commit(session, first, 3, whole=False)


#: Path name -> workload.
STORE_PATHS: dict[str, Callable[[Session], None]] = {
    "save-full": save_full,
    "save-delta": save_delta,
    "compaction": compaction,
    "gc": gc,
    "retention": retention,
    "leases": leases,
    "journal": journal,
}
