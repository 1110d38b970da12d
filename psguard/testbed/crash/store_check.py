"""The check after a crash of a durable-log path: the store holds exactly what was acknowledged, nothing torn.

From the run's history (:mod:`psguard.testbed.crash.store_paths` says its vocabulary) and a fresh process's look
at the store:

- every checkpoint listed reads, verifies (``verify``: every chunk's size, CRC32C and SHA-256) and restores
  bit-identically to the model's state at its step; ``load_latest`` restores the newest, skipping nothing;
- every acknowledged commit is there, unless an operation that may delete checkpoints (gc, retention) began
  after it was made; the newest acknowledged step (or a later one) is there whatever such an operation did;
- nothing else is there but what the operation in flight at the crash may have committed (its steps, at most
  its count): committed but not yet acknowledged is allowed, never acknowledged-and-lost;
- the journal holds an entry for every acknowledged commit (but the one whose tidying, which writes its entry,
  was in flight) and none it cannot account for, every entry readable;
- the next gc (keeping everything but chains folded by compaction, no grace for young chunks) goes ahead despite
  what the dead process left (its leases, temporary objects), deletes no chunk a checkpoint needs (all verify and
  restore again after it), and leaves no temporary object and no lease behind;
- the next save (a delta on the newest checkpoint) commits and restores.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from psguard.errors import PsguardError
from psguard.store import Store
from psguard.store.manifest import JOURNAL_PREFIX, LOCK_PREFIX
from psguard.testbed.crash.session import Op, Run, read_ops
from psguard.testbed.crash.store_paths import delta, state, writer

__all__ = ["Expectations", "check_store", "expectations", "same_arrays"]


@dataclass
class Expectations:
    """What the history says the store must hold."""

    acked: dict[str, int] = field(default_factory=dict)  # checkpoint id -> step
    may_go: set[str] = field(default_factory=set)  # acknowledged, then an operation that may delete began
    in_flight: Op | None = None

    @property
    def newest_step(self) -> int | None:
        return max(self.acked.values(), default=None)

    @property
    def allowed_steps(self) -> set[int]:
        return set(self.in_flight.value.get("steps", [])) if self.in_flight is not None else set()

    @property
    def allowed_new(self) -> int:
        return int(self.in_flight.value.get("new", 0)) if self.in_flight is not None else 0


def expectations(ops: list[Op]) -> Expectations:
    out = Expectations()
    for op in ops:
        if not op.done:
            out.in_flight = op
        if "keep_last" in op.invoked:  # may delete whatever was committed before it began, or by itself
            out.may_go.update(out.acked)
        made = {str(cid): int(step) for cid, step in op.value.get("commits", [])} if op.done else {}
        out.acked.update(made)
        if "keep_last" in op.invoked:
            out.may_go.update(made)
    return out


def same_arrays(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> str | None:
    """None when ``got`` is ``want`` bit for bit (names, dtypes, shapes, bytes); else what differs."""
    if sorted(got) != sorted(want):
        return f"tensors {sorted(got)} instead of {sorted(want)}"
    for name, value in want.items():
        other = got[name]
        if other.dtype != value.dtype or other.shape != value.shape or other.tobytes() != value.tobytes():
            return f"tensor {name!r} differs"
    return None


def check_store(run: Run) -> list[str]:
    """The problems found (none: the point passes)."""
    exp = expectations(read_ops(run.history))
    problems: list[str] = []
    try:
        with run.open_store(chunk_grace=0) as store:
            steps = _listed(store, exp, run.seed, problems)
            _journal(store, exp, steps, problems)
            if not problems:
                _after(store, steps, run.seed, problems)
    except PsguardError as e:
        problems.append(f"the store failed a fresh process: {type(e).__name__}: {e}")
    return problems


def _listed(store: Store, exp: Expectations, seed: int, problems: list[str]) -> dict[str, int]:
    """Check what the store lists against the history; return the checkpoints listed with their steps."""
    steps: dict[str, int] = {}
    for cid in store.checkpoint_ids():
        try:
            steps[cid] = store.manifest(cid).step
        except PsguardError as e:
            problems.append(f"checkpoint {cid}: its manifest cannot be read: {e}")
    unacked = sorted(cid for cid in steps if cid not in exp.acked)
    for cid in unacked:
        if steps[cid] not in exp.allowed_steps:
            problems.append(f"checkpoint {cid} (step {steps[cid]}) was neither acknowledged nor in flight")
    if len(unacked) > exp.allowed_new:
        problems.append(f"{len(unacked)} unacknowledged checkpoints, the operation in flight makes {exp.allowed_new}")
    for cid, step in sorted(exp.acked.items()):
        if cid not in steps and cid not in exp.may_go:
            problems.append(f"acknowledged checkpoint {cid} (step {step}) is lost")
    newest = exp.newest_step
    if newest is not None and not any(step >= newest for step in steps.values()):
        problems.append(f"no checkpoint of the newest acknowledged step {newest} (or a later one)")
    _restorable(store, steps, seed, problems, "")
    if steps:
        try:
            latest = store.load_latest()
            if latest.skipped or latest.info.step != max(steps.values()):
                problems.append(
                    f"load_latest restored step {latest.info.step} skipping {[p.checkpoint for p in latest.skipped]}"
                )
        except PsguardError as e:
            problems.append(f"load_latest failed: {e}")
    return steps


def _restorable(store: Store, steps: dict[str, int], seed: int, problems: list[str], when: str) -> None:
    for cid, step in sorted(steps.items()):
        report = store.verify(cid)
        if not report.ok:
            problems.append(f"checkpoint {cid} (step {step}) is torn{when}: {report.problems[0].message}")
            continue
        try:
            wrong = same_arrays(store.load(cid), state(seed, step))
        except PsguardError as e:
            wrong = f"{type(e).__name__}: {e}"
        if wrong is not None:
            problems.append(f"checkpoint {cid} (step {step}) does not restore its step{when}: {wrong}")


def _journal(store: Store, exp: Expectations, steps: dict[str, int], problems: list[str]) -> None:
    entries = store.journal()
    keys = store.backend.keys(JOURNAL_PREFIX)
    if len(entries) != len(keys):
        problems.append(f"the journal has {len(keys)} entries of which {len(entries)} read")
    journaled = {str(e.get("id")): e.get("step") for e in entries}
    journaling = exp.in_flight.value.get("journal") if exp.in_flight is not None else None
    for cid in sorted(set(exp.acked) - set(journaled) - {journaling}):
        problems.append(f"acknowledged checkpoint {cid} has no journal entry")
    for cid in sorted(set(journaled) - set(exp.acked) - set(steps)):
        if journaled[cid] not in exp.allowed_steps:  # the operation in flight may commit, then delete it
            problems.append(f"the journal names checkpoint {cid}, never acknowledged and not in the store")


def _after(store: Store, steps: dict[str, int], seed: int, problems: list[str]) -> None:
    """The next gc and the next save, as the job's next writer makes them."""
    try:
        report = store.gc(keep_last=1000)
    except PsguardError as e:
        problems.append(f"the next gc failed: {e}")
        return
    if report.corrupt:
        problems.append(f"the next gc found corrupt checkpoints: {[p.message for p in report.corrupt]}")
    after = {cid: step for cid in store.checkpoint_ids() if (step := steps.get(cid)) is not None}
    # It keeps everything but a chain folded by compaction into a full copy that is there (superseded).
    folded = {str(store.manifest(cid).metadata.get("compacted_from")) for cid in after}
    if set(after) != set(steps) - folded:
        problems.append(f"the next gc changed the checkpoints: {sorted(steps)} -> {sorted(after)}")
    _restorable(store, after, seed, problems, " after the next gc")
    left = store.backend.leftovers()
    locks = store.backend.keys(LOCK_PREFIX)
    if left or locks:
        problems.append(f"left after the next gc: temporaries {left[:5]}, locks {locks[:5]}")
    latest = store.latest()
    step = (latest.step if latest is not None else 0) + 1
    dw = writer(store)
    dw.adopt(latest)
    try:
        updates: dict[str, Any] = dict(delta(seed, step)) if latest is not None else dict(state(seed, step))
        info = dw.save(step, updates, whole=latest is None)
        wrong = same_arrays(store.load(info.id), state(seed, step))
    except PsguardError as e:
        wrong = f"{type(e).__name__}: {e}"
    if wrong is not None:
        problems.append(f"the next save (step {step}) failed: {wrong}")
