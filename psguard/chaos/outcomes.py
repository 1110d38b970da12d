"""What each injected fault cost, read from a chaos history: the restore it caused or shared, the steps it lost
against its bound, and the seconds until training came back and until it ran at its normal speed again.

The checkers judge these figures (:mod:`psguard.chaos.checkers`) and the report prints them
(:mod:`psguard.chaos.report`); both read the history through the same :class:`Context` and the nemesis's
vocabulary defined here (the faults, the heals, which heal ends which fault).

Attribution. Faults may overlap (a kill during a storage outage), so a restore is attributed to *every* fault
active when it started, not only the latest: a fault is active from its invoke until its heal (a pause, an
outage, a dead agent) or, for faults nothing heals (a kill, a hang, damage), until training makes progress again.
A restore also belongs to a fault whose effect is over if no other fault began in between (a frozen PS its agent
replaced after the SIGCONT). The first restore in a fault's reach is its restore; the steps it lost are reported
for each fault that shares it (``restore_shared_with``), each judged against the largest bound among them
(``bound_applied``): which of two simultaneous faults cost the steps cannot be told apart.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from psguard.benchmarks.common import Stretch, back_to_normal, seconds_per_step
from psguard.chaos.history import Op, Record, harness_seconds, operations

__all__ = [
    "FAULTS",
    "HEALED_BY",
    "HEALS",
    "STORE_OUTAGES",
    "Context",
    "context",
    "fault_outcomes",
    "faults_during",
    "heal_of",
    "loses_memory_tier",
    "outcomes_of",
]

FAULTS = (
    "kill", "terminate", "pause", "kill-agent", "terminate-agent", "pause-agent", "corrupt-chunk",
    "truncate-chunk", "storage-stop", "partition", "delay", "drop", "hang", "store-errors",
)  # fmt: skip
HEALS = ("resume", "start-agent", "storage-start", "heal")
#: Faults that keep the durable log from taking commits while they last (on the ``store`` target).
STORE_OUTAGES = ("storage-stop", "store-errors", "partition", "drop")
#: The heal that ends each fault that lasts (the others last until training makes progress again).
HEALED_BY = {
    "pause": "resume", "pause-agent": "resume", "kill-agent": "start-agent", "terminate-agent": "start-agent",
    "storage-stop": "storage-start", "partition": "heal", "delay": "heal", "drop": "heal", "store-errors": "heal",
}  # fmt: skip


@dataclass(frozen=True)
class Context:
    """What every checker needs, derived once from the history (still pure: only records in, values out)."""

    ops: list[Op]
    run: Mapping[str, Any]
    final_store: Mapping[str, Any] | None
    cleanup: Mapping[str, Any] | None

    def of(self, f: str | Sequence[str], type: str | None = None, process: str | None = None) -> list[Op]:
        fs = (f,) if isinstance(f, str) else tuple(f)
        return [
            o
            for o in self.ops
            if o.f in fs and (type is None or o.type == type) and (process is None or o.process == process)
        ]

    def trainer(self, f: str | Sequence[str], type: str | None = None) -> list[Op]:
        return [o for o in self.of(f, type) if o.process.startswith("trainer")]

    def corrupted(self, before: float | None = None) -> set[str]:
        """Checkpoints a nemesis made unusable on purpose (their chain holds a damaged chunk)."""
        out: set[str] = set()
        for o in self.of(("corrupt-chunk", "truncate-chunk"), "ok"):
            if before is None or o.start < before:
                out.update(o.value.get("affected", []))
        return out


def context(records: Iterable[Record]) -> Context:
    ops = operations(records)
    run = next((o.value for o in ops if o.process == "harness" and o.f == "run"), {})
    final = next((o.value for o in ops if o.process == "harness" and o.f == "final-store" and o.type == "ok"), None)
    cleanup = next((o.value for o in ops if o.process == "harness" and o.f == "cleanup" and o.type == "ok"), None)
    return Context(ops, run, final, cleanup)


def loses_memory_tier(fault: Op, peer_copies: bool) -> bool:
    """Whether ``fault`` makes every memory commit made before it unrestorable.

    The chief's agent killed or stopped: it held the tier's commits in its memory. A PS's agent killed or
    stopped (a PS node loss): it held that PS's shards, and a memory commit needs every PS's shards, so the
    trainer falls back to the durable log; unless the PS agents keep a copy of each other's shards
    (``peer_copies`` in the run record), when a peer's copy still serves the memory commit.
    """
    if fault.f not in ("kill-agent", "terminate-agent"):
        return False
    target = str(fault.value.get("target", ""))
    return target == "chief" or (target.startswith("ps:") and not peer_copies)


def heal_of(fault: Op, heals: Sequence[Op], since: float) -> Op | None:
    """The first heal of ``fault``'s kind and target at or after ``since`` (None: not healed, or not healable)."""
    kind, target = HEALED_BY.get(fault.f), fault.value.get("target")
    return next((h for h in heals if h.f == kind and h.start >= since and h.value.get("target") == target), None)


def faults_during(ctx: Context, begin: float, end: float) -> list[Op]:
    """The faults injected in [begin, end), or injected before and not healed by ``begin`` (a store still down):
    what may have cut an operation in that span short (a restore whose PS was frozen under it)."""
    heals = [o for o in ctx.of(HEALS) if o.process == "nemesis"]
    out: list[Op] = []
    for f in ctx.of(FAULTS, "ok"):
        if f.process != "nemesis" or f.start >= end:
            continue
        if f.start < begin:
            heal = heal_of(f, heals, f.start)
            if f.f not in HEALED_BY or (heal is not None and heal.start <= begin):
                continue
        out.append(f)
    return out


def fault_outcomes(records: Iterable[Record]) -> list[dict[str, Any]]:
    """Per injected fault: the restore that followed it (if any), lost steps, and seconds until training
    made progress again (the first ``train`` invoked after the fault that completed ok)."""
    return outcomes_of(context(records))


def outcomes_of(ctx: Context) -> list[dict[str, Any]]:
    """Per fault: the restore it caused or shared, lost steps, the bound, seconds until training came back (each
    restore attributed as the module's docstring says)."""
    timeline = _Timeline.of(ctx)
    reaches = [timeline.reach(i, fault) for i, fault in enumerate(timeline.faults)]
    return [_outcome(reach, reaches, timeline.trains) for reach in reaches]


def _group(f: Op) -> tuple[Any, Any]:
    return f.value.get("fault"), f.value.get("at_step")  # ``ps:*`` is one fault on every PS


def _stretches(trains: Sequence[Op]) -> list[Stretch]:
    """The trainer's ``train`` chunks as stretches of steps (see :func:`psguard.benchmarks.common.back_to_normal`)."""
    return [(o.start, o.end, int(o.invoke.value.get("steps", 0))) for o in trains if o.end is not None]


@dataclass(frozen=True)
class _Reach:
    """One fault and what followed it within its reach, before the faults sharing a restore are compared."""

    op: Op
    t: float  # when the fault was in place (its completion)
    heal: Op | None
    resumed: Op | None  # the first chunk of steps started after the fault
    restore: Op | None
    bound: Any  # steps it may lose: the scenario's ``max_lost_steps``, else the policy's
    normal_at: float | None
    until: float  # active until healed and training came back


@dataclass(frozen=True)
class _Timeline:
    """The operations the attribution reads, and the job's pace before the first fault."""

    ctx: Context
    faults: list[Op]
    heals: list[Op]
    trains: list[Op]
    restores: list[Op]
    captures: list[Op]
    timed: list[Op]  # the records that carry the harness's digest time
    normal: float | None = None  # seconds per step before the first fault

    @classmethod
    def of(cls, ctx: Context) -> _Timeline:
        faults = [o for o in ctx.of(FAULTS) if o.process == "nemesis" and o.type == "ok"]
        heals = [o for o in ctx.of(HEALS) if o.process == "nemesis"]
        trains, restores = ctx.trainer("train", "ok"), ctx.trainer("restore", "ok")
        captures = ctx.trainer("capture", "ok")
        timeline = cls(ctx, faults, heals, trains, restores, captures, [*captures, *restores])
        first_fault = min((f.start for f in faults), default=float("inf"))
        before = _stretches([o for o in trains if o.end is not None and o.end < first_fault][2:])
        return replace(timeline, normal=seconds_per_step(before, excluded=timeline.harness))

    def harness(self, begin: float, end: float) -> float:
        return harness_seconds(self.timed, begin, end)

    def reach(self, i: int, fault: Op) -> _Reach:
        t = fault.end or fault.start
        heal = heal_of(fault, self.heals, t)
        # Recovered: a chunk of steps started after the fault completed (training may come back before the
        # heal, e.g. when an agent replaces a frozen PS).
        resumed = next((o for o in self.trains if o.start >= t), None)
        # Active until healed and training came back: a lost PS node's heal (its new agent) comes before the
        # restore it causes (a 1-h soak gave that restore to a store outage begun a second after the heal).
        active_until = resumed.start if resumed is not None else float("inf")
        if heal is not None:
            active_until = max(active_until, heal.end if heal.end is not None else heal.start)
        nxt = next((f.start for f in self.faults[i + 1 :] if _group(f) != _group(fault)), float("inf"))
        restore = next(
            (r for r in self.restores if r.start >= fault.start and (r.start <= active_until or r.start < nxt)), None
        )
        return _Reach(fault, t, heal, resumed, restore, self.bound(fault), self.normal_at(t, restore), active_until)

    def bound(self, fault: Op) -> Any:
        """The steps ``fault`` may lose: the memory tier's cadence and a chunk, or, when the fault takes the memory
        tier with it, the durable cadence as it runs (its time floor turned into steps at the job's pace) and a
        chunk, plus whatever trained while the store was failing: the durable hold ends at a store's first failed
        request (:mod:`psguard.policy.lag`) and the lag it then lets grow is the documented trade. A scenario may
        set its own."""
        bound = fault.value.get("max_lost_steps")
        if bound is not None:
            return bound
        training = self.ctx.run.get("training", {})
        chunk = int(training.get("chunk", 0))
        if not loses_memory_tier(fault, bool(self.ctx.run.get("peer_copies", False))):
            return int(training.get("memory_every", 0)) + chunk
        every, floor = int(training.get("durable_every", 0)), float(training.get("durable_min_seconds") or 0.0)
        if floor and self.normal:
            every = max(every, math.ceil(floor / self.normal))
        return every + chunk + self.trained_through_store_outage(fault.start)

    def step_at(self, t: float) -> int:
        return _step_at(self.trains, t)

    def trained_through_store_outage(self, t: float) -> int:
        """Steps trained between the start of a store outage still on at ``t`` (or healed after the newest
        durable commit acknowledged before ``t``) and ``t``: durable commits could not land meanwhile."""
        durable = [c.end for c in self.ctx.trainer("durable-commit", "ok") if c.end is not None and c.end <= t]
        last_durable = max(durable, default=float("-inf"))
        began = [
            f.start for f in self.faults
            if f.f in STORE_OUTAGES and f.value.get("target") == "store" and f.start < t
            and ((h := heal_of(f, self.heals, f.start)) is None or (h.end or h.start) > last_durable)
        ]  # fmt: skip
        return max(0, self.step_at(t) - self.step_at(min(began))) if began else 0

    def normal_at(self, t: float, restore: Op | None) -> float | None:
        """When training ran at its normal speed again: after the first capture that followed the restore (its
        stall counts)."""
        since = restore.end if restore is not None and restore.end is not None else t
        first_capture = next((c.end for c in self.captures if c.start >= since and c.end is not None), since)
        after = _stretches([o for o in self.trains if o.start >= t])
        return back_to_normal(after, self.normal, not_before=first_capture, excluded=self.harness)


def _step_at(trains: Sequence[Op], t: float) -> int:
    """The step training had reached at ``t``: the newest ``train`` chunk completed by then (0 before any)."""
    return max((int(o.value["step"]) for o in trains if (o.end or 0) <= t), default=0)


def _outcome(reach: _Reach, reaches: Sequence[_Reach], trains: Sequence[Op]) -> dict[str, Any]:
    """The report's row for one fault, with the faults that share its restore or overlap it."""
    fault, t, heal, resumed, restore = reach.op, reach.t, reach.heal, reach.resumed, reach.restore
    lost = None
    sharing = [r for r in reaches if r is not reach and restore is not None and r.restore is restore]
    overlapping = [
        r for r in reaches if _group(r.op) != _group(fault) and r.op.start <= reach.until and fault.start <= r.until
    ]
    if restore is not None:
        lost = max(0, _step_at(trains, restore.start) - int(restore.value.get("step", 0)))
    return {
        "fault": fault.f,
        "target": fault.value.get("target"),
        "at": t,
        "at_step": fault.value.get("at_step"),
        "healed_at": heal.end if heal is not None else None,
        "restored_step": int(restore.value["step"]) if restore is not None else None,
        "restore_source": restore.value.get("source") if restore is not None else None,
        "restore_at": restore.start if restore is not None else None,
        "restore_shared_with": [f"{r.op.f} {r.op.value.get('target')}" for r in sharing],
        # Other faults active at the same time: this recovery's time is theirs as much as its own.
        "overlaps_with": [f"{r.op.f} {r.op.value.get('target')}" for r in overlapping],
        # No restore: nothing lost if training went on (a worker fault), unknown if it never did.
        "lost_steps": lost if restore is not None else (0 if resumed is not None else None),
        "max_lost_steps": reach.bound,
        "bound_applied": max([reach.bound, *(r.bound for r in sharing)]),
        # The first chunk of steps done after the fault, and training back at normal speed (what a recovery
        # costs: a slow first capture after the restore is part of it).
        "resumed_seconds": (resumed.end - t) if resumed is not None and resumed.end is not None else None,
        "recovery_seconds": reach.normal_at - t if reach.normal_at is not None else None,
    }
