"""Checkers: pure functions over a chaos history, each returning valid, invalid or unknown with evidence.

They read nothing but the records (Jepsen's checkers do the same): the final state of the store and the
clean-up audit are operations of the history too (``final-store`` and ``cleanup`` of process ``harness``),
so ``psguard chaos check history.jsonl`` judges a finished run again without its cluster or storage. What each
fault cost (its restore, lost steps, recovery time) is reckoned in :mod:`psguard.chaos.outcomes`; the checkers
here judge it.

The vocabulary of the history they rely on (see :mod:`psguard.demo_trainer` and :mod:`psguard.chaos.nemesis`):

- trainer processes ``trainer-<pid>``: ``train`` (value ``step`` = the step after the chunk), ``capture``
  (``step``; ``digest`` on the invoke, so that a capture cut short by the trainer's death still has one),
  ``memory-commit``, ``durable-commit`` (``id``), ``restore`` (``step``, ``source``, ``id``, ``digest``),
  ``eval`` (``loss``);
- ``nemesis``: the faults (``kill``, ``terminate``, ``pause``, ``kill-agent``, ``corrupt-chunk``,
  ``truncate-chunk``, ``storage-stop``, ``store-errors``, the network's) and heals (``resume``, ``start-agent``,
  ``storage-start``, ``heal``); a fault aimed at a moment says whether it found it (``moment_found``;
  ``persist_in_flight`` in older histories) and ``missed`` when the moment did not come while the run lasted;
- ``harness``: ``run`` (the run's parameters, the target step, the bounds, ``peer_copies``: whether the PS
  agents keep copies of each other's shards, absent = no), ``final-store``, ``cleanup``.

Outcome rules. A commit with an ``ok`` completion happened. One with ``fail`` did not. One with ``info`` or
no completion (its process died) may or may not have: a restore may return it or anything older than it, up to
the newest commit known to have happened.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from psguard.chaos.history import Op, Record
from psguard.chaos.outcomes import FAULTS, HEALS, Context, context, faults_during, loses_memory_tier, outcomes_of
from psguard.chaos.resources import (
    STORE_SETTLE,
    THREADS_PER_RECOVERY,
    WEEK_HOURS,
    less_recovery_threads,
    recovery_times,
    resource_lives,
    series_bound,
    slope_fit,
)

__all__ = ["CHECKERS", "SOAK_CHECKERS", "Verdict", "check_all", "missed_moments", "overall"]

Status = Literal["valid", "invalid", "unknown"]
COMMITS = ("memory-commit", "durable-commit")


@dataclass(frozen=True)
class Verdict:
    checker: str
    status: Status
    summary: str
    evidence: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "summary": self.summary, "evidence": dict(self.evidence)}


# ------------------------------------------------------------------------------------------------ checkers
def durable_commits_kept(ctx: Context) -> Verdict:
    """Every durable commit the trainer saw acknowledged is in the final store and reads back whole."""
    name = "durable-commits-kept"
    if ctx.final_store is None:
        return Verdict(name, "unknown", "the history has no final-store record (the run did not finish)")
    present = {c["id"]: c for c in ctx.final_store.get("checkpoints", [])}
    deleted_by_gc = [i for o in ctx.of("gc", "ok") for i in o.value.get("deleted_checkpoints", [])]
    corrupted = ctx.corrupted()
    acked = [o for o in ctx.trainer("durable-commit", "ok")]
    missing = [o.value.get("id") for o in acked if o.value.get("id") not in present]
    unreadable = [
        o.value["id"]
        for o in acked
        if o.value.get("id") in present and not present[o.value["id"]]["ok"] and o.value["id"] not in corrupted
    ]
    missing += [i for i in deleted_by_gc if i in {o.value.get("id") for o in acked}]  # the final gc keeps all
    # A job with retention (``max_to_keep``: a soak's store must stay bounded) deletes its older commits. It
    # keeps the newest ``keep`` commits of the store, acknowledged or not (a commit whose answer a killed trainer
    # never read is a commit all the same): an acknowledged one may be gone only with ``keep`` newer ones there.
    keep = ctx.run.get("training", {}).get("max_to_keep")
    retired: list[Any] = []
    if isinstance(keep, int) and keep > 0:
        step_of = {o.value.get("id"): int(o.value.get("step", 0)) for o in acked}

        def newer_kept(cid: Any) -> int:
            return sum(1 for c in present.values() if c["id"] != cid and int(c.get("step", 0)) >= step_of[cid])

        newer = {i: newer_kept(i) for i in missing}
        retired = [i for i in missing if newer[i] >= keep]
        missing = [i for i in missing if newer[i] < keep]
    evidence = {"acknowledged": len(acked), "missing": missing, "unreadable": unreadable, "retired": len(retired)}
    if not acked:
        return Verdict(name, "unknown", "no durable commit was acknowledged during the run", evidence)
    if missing or unreadable:
        return Verdict(name, "invalid", f"{len(missing)} acknowledged commit(s) missing, {len(unreadable)} unreadable",
                       evidence)  # fmt: skip
    if retired:
        kept = len(acked) - len(retired)
        return Verdict(name, "valid", f"of {len(acked)} acknowledged durable commits, the newest {kept} are in the "
                       f"store and verify; {len(retired)} older ones were deleted by retention", evidence)  # fmt: skip
    return Verdict(
        name, "valid", f"all {len(acked)} acknowledged durable commits are in the store and verify", evidence
    )


def no_torn_checkpoint(ctx: Context) -> Verdict:
    """Every checkpoint visible in the store is complete and verifies, unless the nemesis damaged it on purpose,
    and none is for a step no trainer ever captured (a phantom)."""
    name = "no-torn-checkpoint"
    if ctx.final_store is None:
        return Verdict(name, "unknown", "the history has no final-store record (the run did not finish)")
    corrupted = ctx.corrupted()
    visible = ctx.final_store.get("checkpoints", [])
    torn = [
        {"id": c["id"], "problems": c.get("problems", [])} for c in visible if not c["ok"] and c["id"] not in corrupted
    ]
    captured = {o.value.get("step") for o in ctx.trainer("capture") if o.type in ("ok", "info")}
    phantoms = [c["id"] for c in visible if c["step"] not in captured]
    damaged_detected = [c["id"] for c in visible if c["id"] in corrupted and not c["ok"]]
    # A damaged checkpoint that verifies is a miss of the verification, unless the damaged chunk is whole again:
    # a later checkpoint with the same content (deterministic training after a restore) wrote it anew.
    healthy_now = ctx.final_store.get("damaged_chunks", {})
    repaired: set[str] = set()
    for o in ctx.of(("corrupt-chunk", "truncate-chunk"), "ok"):
        if healthy_now.get(str(o.value.get("chunk"))):
            repaired.update(o.value.get("affected", []))
    damaged_missed = [c["id"] for c in visible if c["id"] in corrupted and c["ok"] and c["id"] not in repaired]
    evidence = {
        "damaged_then_rewritten_whole": sorted(repaired),
        "visible": len(visible),
        "torn": torn,
        "phantoms": phantoms,
        "damaged_by_nemesis_detected": damaged_detected,
        "damaged_by_nemesis_undetected": damaged_missed,
    }
    if torn or phantoms or damaged_missed:
        return Verdict(
            name, "invalid",
            f"{len(torn)} torn, {len(phantoms)} phantom, {len(damaged_missed)} damaged but verifying", evidence,
        )  # fmt: skip
    return Verdict(name, "valid", f"all {len(visible)} visible checkpoints are whole (damage detected where made)",
                   evidence)  # fmt: skip


def _memory_lost_at(ctx: Context) -> list[tuple[float, float]]:
    """Each loss of the memory tier (:func:`~psguard.chaos.outcomes.loses_memory_tier`): its invoke and
    completion. The agent dies in between, so a memory commit acknowledged there (just before the signal landed)
    went with it."""
    stops = ctx.of(("kill-agent", "terminate-agent"))
    peer_copies = bool(ctx.run.get("peer_copies", False))
    return [(o.start, o.end or o.start) for o in stops if o.type != "fail" and loses_memory_tier(o, peer_copies)]


def restores_newest(ctx: Context) -> Verdict:
    """Each restore took the newest commit known to have happened before it (memory or durable), or an older
    one only when every newer one's outcome is unknown; never one that cannot exist."""
    name = "restore-newest"
    restores = ctx.trainer("restore")
    problems: list[dict[str, Any]] = []
    checked: list[dict[str, Any]] = []
    memory_lost = _memory_lost_at(ctx)
    interrupted: list[dict[str, Any]] = []
    starts = sorted(r.start for r in restores)
    trainer_ops = [o for o in ctx.ops if o.process.startswith("trainer")]
    for r in restores:
        if r.type != "ok":
            row = {"restore_at": r.start, "process": r.process, "error": r.value.get("error", "no completion")}
            # From the last record of the trainer before this one (this one was started after it: a PS killed
            # while the new trainer was still building its job leaves it holding the dead incarnation's devices)
            # until the next restore began (by this process or its successor): a fault then may have ended it.
            me = r.process.split("/")[0]
            before = [o.end or o.start for o in trainer_ops if o.process.split("/")[0] != me and o.start < r.start]
            until = next((t for t in starts if t > r.start), float("inf"))
            faults = [
                _fault_name(f)
                for f in faults_during(ctx, min(max(before, default=r.start), r.start), until)
                if f.start >= r.start or f.value.get("target") != "chief"  # that one ended the trainer before
            ]
            if faults:
                interrupted.append({**row, "faults": faults})
            else:
                problems.append({**row, "why": "the restore failed with no fault to explain it"})
            continue
        corrupted = ctx.corrupted(before=r.start)
        lost_before = max((end for start, end in memory_lost if start < r.start), default=None)
        ok_steps: list[int] = []
        maybe_steps: list[int] = []
        for c in ctx.trainer(COMMITS):
            if c.start >= r.start:
                continue
            if c.f == "memory-commit" and lost_before is not None and c.start < lost_before:
                continue  # that memory tier is gone with the agent that held it
            if c.f == "durable-commit" and c.value.get("id") in corrupted:
                continue
            if c.type == "ok" and (c.end or 0) < r.start:
                ok_steps.append(int(c.value["step"]))
            elif c.type == "info" or c.type == "ok":
                maybe_steps.append(int(c.value["step"]))
        for c in ctx.trainer("capture"):
            # A capture handed to the agent may be in its memory tier even if the trainer died right after.
            memory_gone = lost_before is not None and c.start < lost_before
            if c.start < r.start and c.type != "fail" and not memory_gone:
                maybe_steps.append(int(c.value["step"]))
        newest_ok = max(ok_steps, default=0)
        got = int(r.value.get("step", 0))
        row = {"restore_at": r.start, "process": r.process, "restored": got, "source": r.value.get("source"),
               "newest_ok": newest_ok, "unknown_newer": sorted(s for s in maybe_steps if s > newest_ok)}  # fmt: skip
        checked.append(row)
        if got == newest_ok:
            continue
        if got > newest_ok and got in maybe_steps:
            continue  # an unknown-outcome commit that did happen
        if got < newest_ok:
            problems.append({**row, "why": "an older checkpoint than the newest acknowledged commit"})
        else:
            problems.append({**row, "why": "a step no commit was invoked for"})
    evidence = {"restores": checked, "problems": problems, "interrupted": interrupted}
    if not restores:
        return Verdict(name, "unknown", "no restore happened", evidence)
    if problems:
        return Verdict(name, "invalid", f"{len(problems)} of {len(restores)} restore(s) wrong", evidence)
    done = len(restores) - len(interrupted)
    cut = f" ({len(interrupted)} more cut short by a fault, the next one judged)" if interrupted else ""
    return Verdict(name, "valid", f"all {done} restores took the newest commit{cut}", evidence)


def _fault_name(f: Op) -> str:
    return str(f.value.get("fault") or f"{f.f} {f.value.get('target', '')}")


def restores_exact(ctx: Context) -> Verdict:
    """The variables after each restore are exactly those captured at the restored step: every model and
    optimizer tensor, every shard, one step (the digests taken on the PS after capture and after restore)."""
    name = "restore-exact"
    captures: dict[int, list[Mapping[str, str]]] = {}
    for c in ctx.trainer("capture"):
        if c.type != "fail" and isinstance(c.value.get("digest"), Mapping):
            captures.setdefault(int(c.value["step"]), []).append(c.value["digest"])
    checked, problems, unknown = [], [], []
    for r in ctx.trainer("restore", "ok"):
        step, digest = int(r.value.get("step", 0)), r.value.get("digest")
        if not r.value.get("source"):
            continue  # nothing to restore: the job started fresh
        if not isinstance(digest, Mapping):
            unknown.append({"step": step, "why": "the trainer took no digest (--digest off)"})
        elif step not in captures:
            unknown.append({"step": step, "why": "no capture of that step in the history"})
        elif any(digest.get("*") == c.get("*") for c in captures[step]):
            checked.append({"step": step, "source": r.value.get("source"), "digest": str(digest.get("*"))[:16]})
        else:
            captured = captures[step][-1]
            differ = sorted(k for k in set(digest) | set(captured) if k != "*" and digest.get(k) != captured.get(k))
            problems.append({"step": step, "source": r.value.get("source"), "restore_at": r.start,
                             "variables_differing": differ})  # fmt: skip
    evidence = {"matched": checked, "mismatched": problems, "unchecked": unknown}
    if problems:
        return Verdict(name, "invalid", f"{len(problems)} restore(s) differ from what was captured", evidence)
    if unknown:
        return Verdict(name, "unknown", f"{len(checked)} restore(s) checked, {len(unknown)} could not be", evidence)
    if not checked:
        return Verdict(name, "valid", "no restore from a checkpoint happened: nothing to compare", evidence)
    return Verdict(name, "valid", f"all {len(checked)} restores are bit-identical to their capture", evidence)


def lost_work_bounded(ctx: Context) -> Verdict:
    """Steps lost per fault stay within the policy bound (memory-tier cadence + one chunk by default; the durable
    cadence + one chunk when the fault takes the memory tier with it: the chief's agent, or a PS's agent without
    peer copies; a scenario may set its own ``max_lost_steps``)."""
    name = "lost-work-bounded"
    outcomes = outcomes_of(ctx)
    over = [o for o in outcomes if o["lost_steps"] is not None and o["lost_steps"] > o["bound_applied"]]
    evidence = {"faults": outcomes, "over_bound": over}
    if not outcomes:
        return Verdict(name, "unknown", "no fault was injected", evidence)
    if over:
        return Verdict(name, "invalid", f"{len(over)} fault(s) lost more steps than their bound", evidence)
    if any(o["lost_steps"] is None for o in outcomes):
        never = sum(1 for o in outcomes if o["lost_steps"] is None)
        return Verdict(name, "unknown", f"{never} fault(s) never recovered from: their loss is unknown", evidence)
    lost = [o["lost_steps"] for o in outcomes]
    return Verdict(name, "valid", f"{len(outcomes)} fault(s), lost steps {lost}, all within bound", evidence)


#: Seconds a hung trainer's replacement may take, past the hang bound, to restore: the agent's watch (1 s), the
#: stack dump (2 s), the PS restarts of the new generation and a Python + TensorFlow start on a loaded machine.
HANG_RESTART_SLACK = 90.0


def hang_detected(ctx: Context) -> Verdict:
    """Each hung trainer was found and replaced: a restore by a new trainer started within the hang bound plus
    the time a restart takes (``HANG_RESTART_SLACK``) after the hang was injected."""
    name = "hang-detected"
    hangs = [o for o in ctx.of(("hang",)) if o.process == "nemesis" and o.type == "ok"]
    if not hangs:
        return Verdict(name, "valid", "no hang was injected: nothing to detect", {})
    bound = ctx.run.get("training", {}).get("hang_after")
    if bound is None:
        return Verdict(name, "unknown", "a hang was injected but the trainer had no hang bound (training.hang_after)")
    restores = [r for r in ctx.trainer("restore", "ok")]
    found: list[dict[str, Any]] = []
    missed: list[dict[str, Any]] = []
    for h in hangs:
        t = h.end or h.start
        after = next((r for r in restores if r.start >= t), None)
        seconds = (after.start - t) if after is not None else None
        entry = {"at": t, "restore_after_seconds": seconds, "bound": float(bound) + HANG_RESTART_SLACK}
        (found if seconds is not None and seconds <= float(bound) + HANG_RESTART_SLACK else missed).append(entry)
    evidence = {"found": found, "missed": missed}
    if missed:
        return Verdict(name, "invalid", f"{len(missed)} hang(s) not replaced within their bound", evidence)
    return Verdict(name, "valid", f"{len(found)} hang(s) found and the trainer replaced", evidence)


def liveness(ctx: Context) -> Verdict:
    """Training reached its target step within the bound after the last fault was healed."""
    name = "liveness"
    target = ctx.run.get("target_step")
    finish = [o for o in ctx.of("finish", "ok") if o.process == "harness"]
    if finish:  # a soak: the harness named the last step once its duration was over
        target = finish[-1].value.get("target_step")
    bound = float(ctx.run.get("liveness_seconds", 120.0))
    trains = ctx.trainer("train", "ok")
    faults = [o for o in ctx.of((*FAULTS, *HEALS)) if o.process == "nemesis" and o.type != "fail"]
    last = max(((o.end or o.start) for o in faults), default=None)
    reached = next((o for o in trains if target is not None and int(o.value["step"]) >= int(target)), None)
    evidence = {
        "target_step": target,
        "last_fault_or_heal_at": last,
        "bound_seconds": bound,
        "final_step": max((int(o.value["step"]) for o in trains), default=None),
        "agents_that_gave_up": [o.value for o in ctx.of("agent-exited") if o.process == "harness"],
    }

    if target is None:
        return Verdict(name, "unknown", "the history does not say the target step", evidence)
    if reached is None or reached.end is None:
        return Verdict(name, "invalid", f"the target step {target} was never reached", evidence)
    took = reached.end - (last if last is not None else reached.end)
    evidence["seconds_after_last_heal"] = took
    if took > bound:
        return Verdict(name, "invalid", f"reached step {target} {took:.1f}s after the last heal (> {bound:.0f}s)",
                       evidence)  # fmt: skip
    return Verdict(name, "valid", f"reached step {target} {max(took, 0.0):.1f}s after the last heal", evidence)


def final_loss(ctx: Context, reference: Sequence[Record] | None = None) -> Verdict:
    """The final loss is within tolerance of a fault-free run of the same scenario and seed."""
    name = "final-loss"
    tolerance = float(ctx.run.get("loss_tolerance", 0.05))
    ev = [o for o in ctx.trainer("eval", "ok") if o.value.get("loss") is not None]
    loss = float(ev[-1].value["loss"]) if ev else None
    evidence: dict[str, Any] = {"loss": loss, "tolerance": tolerance}
    if loss is None:
        return Verdict(name, "unknown", "the trainer recorded no final loss", evidence)
    if reference is None:
        return Verdict(name, "unknown", "no fault-free reference run (checks.reference, --reference)", evidence)
    ref_ctx = context(reference)
    ref = [o for o in ref_ctx.trainer("eval", "ok") if o.value.get("loss") is not None]
    if not ref:
        return Verdict(name, "unknown", "the reference run recorded no final loss", evidence)
    ref_loss = float(ref[-1].value["loss"])
    evidence.update({"reference_loss": ref_loss, "difference": abs(loss - ref_loss),
                     "reference_seed": ref_ctx.run.get("seed"), "seed": ctx.run.get("seed")})  # fmt: skip
    if abs(loss - ref_loss) > tolerance:
        return Verdict(name, "invalid", f"final loss {loss:.4f} vs fault-free {ref_loss:.4f} (> {tolerance})", evidence)
    return Verdict(name, "valid", f"final loss {loss:.4f} vs fault-free {ref_loss:.4f}", evidence)


def no_leaks(ctx: Context) -> Verdict:
    """After the run, every process it started is gone, every port it used is free, no temporary file is left,
    and the harness runs no extra thread."""
    name = "no-leaks"
    if ctx.cleanup is None:
        return Verdict(name, "unknown", "the history has no cleanup record")
    keys = ("alive_pids", "busy_ports", "temp_files", "threads")
    leaked = {k: ctx.cleanup.get(k, []) for k in keys if ctx.cleanup.get(k)}
    evidence = {
        **{k: ctx.cleanup.get(k, []) for k in keys},
        "pids_started": len(ctx.cleanup.get("pids_seen", [])),
        "crash_leftovers": ctx.cleanup.get("crash_leftovers", []),
        "store_temp_files_before_gc": (ctx.final_store or {}).get("temp_files", []),
    }
    if leaked:
        return Verdict(name, "invalid", "leaked: " + ", ".join(f"{k} {v}" for k, v in leaked.items()), evidence)
    return Verdict(name, "valid", f"all {evidence['pids_started']} processes gone, ports free, no temp files", evidence)


def faults_injected(ctx: Context) -> Verdict:
    """Every scheduled fault was injected (a run where the nemesis missed is no evidence) and every heal done."""
    name = "faults-injected"
    scheduled = int(ctx.run.get("faults_scheduled", 0))
    faults = [o for o in ctx.of(FAULTS) if o.process == "nemesis"]
    failed = [
        {"f": o.f, "target": o.value.get("target"), "why": o.value.get("error")} for o in faults if o.type != "ok"
    ]
    # A fault aimed at a persist that found none in flight was not the fault the scenario asked for.
    failed += [
        {"f": o.f, "target": o.value.get("target"), "why": "no durable write was in flight"}
        for o in faults
        if o.type == "ok" and o.value.get("persist_in_flight") is False
    ]
    # So was one aimed at a moment of the persister (a first base, a persist, a compaction, a gc) it never saw.
    failed += [
        {"f": o.f, "target": o.value.get("target"), "why": f"no {o.value.get('moment')} came in time"}
        for o in faults
        if o.type == "ok" and o.value.get("moment_found") is False
    ]
    # A fault whose moment did not come while the run lasted (the nemesis says ``missed``): the case could not be
    # run as drawn, which is neither psguard's fault nor the harness's; explore counts such cases apart.
    missed = [o.value.get("moment") for o in faults if o.value.get("missed")]
    heals = [o for o in ctx.of(HEALS) if o.process == "nemesis"]
    unhealed = [o.f for o in heals if o.type != "ok"]
    fired = {o.value.get("fault") for o in faults}
    evidence = {"scheduled": scheduled, "fired": len(fired), "not_injected": failed, "heals_failed": unhealed,
                "missed": missed}  # fmt: skip
    if len(fired) < scheduled:
        return Verdict(name, "invalid", f"only {len(fired)} of {scheduled} scheduled faults fired", evidence)
    if failed or unhealed:
        verdict = Verdict(
            name, "invalid", f"{len(failed)} fault(s) not injected, {len(unhealed)} heal(s) failed", evidence
        )
        only_missed = missed_moments(verdict)
        return replace(verdict, summary="missed: " + ", ".join(only_missed)) if only_missed else verdict
    return Verdict(name, "valid", f"all {scheduled} faults injected and healed", evidence)


def missed_moments(verdict: Verdict) -> list[str]:
    """The moments a faults-injected verdict failed on when missing them is all that failed (else none): every
    fault fired, every heal done, and each fault not injected as asked is one whose moment did not come."""
    e = verdict.evidence
    missed = [str(m) for m in e.get("missed") or []]
    only = e.get("fired") == e.get("scheduled") and not e.get("heals_failed")
    return missed if verdict.status == "invalid" and only and len(e.get("not_injected") or []) == len(missed) else []


# ------------------------------------------------------------------------------------------------ soak
def resources_bounded(ctx: Context, records: Sequence[Record]) -> Verdict:
    """No resource of any psguard process or folder grows, after the warm-up, at a rate that the scenario's
    bounds forbid (each stated per hour; a week is 168 hours of it)."""
    name = "resources-bounded"
    soak = ctx.run.get("soak") or {}
    bounds, warmup = soak.get("bounds") or {}, float(soak.get("warmup", 0.0))
    state_bytes = float(soak.get("state_bytes") or 0)
    rows, over, crowded = [], [], []
    children_max = int(bounds.get("children_max", 4))
    per_recovery = float(bounds.get("threads_per_recovery", THREADS_PER_RECOVERY))
    recoveries = recovery_times(ctx.of("restore"))
    for series, lives in sorted(resource_lives(records).items()):
        points = [p for _, life in lives for p in life]
        judged = points
        if series == "trainer/threads" or (series.startswith("server:worker") and series.endswith("/threads")):
            judged = [p for _, life in lives for p in less_recovery_threads(recoveries, life, per_recovery)]
        if series.endswith("/children"):
            if series.startswith("harness/"):
                continue  # the harness's children are the run's agents and servers, by design
            most = max(v for _, v in points)
            if most > children_max:
                crowded.append({"series": series, "max": most, "bound": children_max})
            continue
        bound = series_bound(series, bounds, state_bytes)
        # A history from before store_settle existed is judged with its default.
        settle = float(bounds.get("store_settle", STORE_SETTLE)) if series.startswith("folder:store/") else 0.0
        fit = slope_fit(judged, warmup=max(warmup, settle))
        if bound is None or fit is None:
            continue
        (slope, stderr), (limit, unit) = fit, bound
        row = {"series": series, "slope_per_hour": slope, "stderr_per_hour": stderr, "bound_per_hour": limit,
               "unit": unit, "last": points[-1][1], "week": points[-1][1] + max(0.0, slope) * WEEK_HOURS}  # fmt: skip
        rows.append(row)
        # Over the bound by more than two standard errors: growth, not a restart's step or noise.
        if slope - 2.0 * stderr > limit:
            over.append(row)
    evidence = {"series": rows, "over": over, "children_over": crowded, "warmup_seconds": warmup}
    if not rows and not crowded:
        return Verdict(name, "unknown", "no resource series with enough samples after the warm-up", evidence)
    if over or crowded:
        worst = ", ".join(f"{r['series']} +{r['slope_per_hour']:.3g} {r['unit']}/h" for r in over[:5])
        worst += "".join(f", {r['series']} reached {r['max']:g} (> {r['bound']})" for r in crowded[:5])
        return Verdict(name, "invalid", f"{len(over) + len(crowded)} resource(s) past their bound: {worst}", evidence)
    return Verdict(name, "valid", f"{len(rows)} resource series within their bounds after the warm-up", evidence)


def recoveries_not_slower(ctx: Context, records: Sequence[Record]) -> Verdict:
    """Each later recovery of a kind of fault is no slower than the first of that kind, within noise: a run
    that gets slower each time would not last a week."""
    name = "recoveries-not-slower"
    bounds = (ctx.run.get("soak") or {}).get("bounds") or {}
    factor, noise = float(bounds.get("recovery_slowdown", 2.0)), float(bounds.get("recovery_noise", 10.0))
    first: dict[str, float] = {}
    slower, judged = [], 0
    for row in outcomes_of(ctx):
        seconds = row.get("recovery_seconds")
        if seconds is None or row.get("overlaps_with"):
            continue  # a fault during another's recovery took both recoveries' time: not this kind's pace
        kind = f"{row['fault']} {str(row['target']).split(':')[0]}"
        if kind not in first:
            first[kind] = seconds
            continue
        judged += 1
        allowed = max(first[kind] * factor, first[kind] + noise)
        if seconds > allowed:
            slower.append({"kind": kind, "at": row["at"], "seconds": seconds, "first": first[kind],
                           "allowed": allowed})  # fmt: skip
    evidence = {"first_by_kind": first, "slower": slower, "judged": judged}
    if not judged:
        return Verdict(name, "unknown", "no kind of fault recovered twice", evidence)
    if slower:
        return Verdict(name, "invalid", f"{len(slower)} recoveries slower than the first of their kind", evidence)
    return Verdict(name, "valid", f"{judged} later recoveries no slower than the first of their kind", evidence)


def alerts_watched(ctx: Context, records: Sequence[Record]) -> Verdict:
    """With Prometheus watching (``soak.prometheus``): no shipped alert fires before the first fault, the one
    meant for repeated restarts (PsguardTaskRestarting) fires for every task the faults restarted three times
    within its 15-minute window, every alert still firing when the duration ended has a fault within its range
    (the others resolved once their cause was healed), and every query of the shipped Grafana dashboard returns
    data as of that end."""
    name = "alerts-watched"
    watch = next((o for o in ctx.of("prometheus") if o.process == "harness"), None)
    if watch is None or watch.type != "ok":
        error = watch.value.get("error") if watch is not None else "no prometheus record"
        return Verdict(name, "invalid", f"Prometheus did not report: {error}", {})
    alerts, dashboard = list(watch.value.get("alerts", [])), dict(watch.value.get("dashboard", {}))
    faults = sorted(o.start for o in ctx.of(FAULTS, "ok") if o.process == "nemesis")
    first_fault = faults[0] if faults else float("inf")
    early = [a for a in alerts if float(a["first"]) < first_fault]
    bursts = set(watch.value.get("restart_bursts", []))
    alerted = {str(a["labels"].get("task")) for a in alerts if a["alert"] == "PsguardTaskRestarting"}
    empty = sorted(expr for expr, n in dashboard.items() if not n)
    evidence = {"alerts": alerts, "dashboard": dashboard, "first_fault": first_fault, "restart_bursts": sorted(bursts)}
    problems = []
    if early:
        problems.append(f"{', '.join(sorted({a['alert'] for a in early}))} fired before the first fault")
    if bursts - alerted:
        problems.append(f"restarted 3 times in 15 minutes, no PsguardTaskRestarting: {sorted(bursts - alerted)}")
    if empty:
        problems.append(f"{len(empty)} dashboard query(ies) returned nothing: {empty[:3]}")
    if not dashboard:
        problems.append("no dashboard query was run")
    unresolved, resolved = _unresolved_alerts(ctx, watch.value, alerts, faults)
    evidence["resolved"], evidence["still_firing_unexplained"] = resolved, unresolved
    if unresolved:
        problems.append(f"still firing at the end with no fault within their window: {unresolved[:3]}")
    if problems:
        return Verdict(name, "invalid", "; ".join(problems), evidence)
    fired = sorted({a["alert"] for a in alerts})
    ended = f"{resolved} resolved before the end" if resolved is not None else "resolution not recorded"
    return Verdict(name, "valid", f"alerts fired: {', '.join(fired) or 'none'} ({ended}); quiet before the first "
                   f"fault; all {len(dashboard)} dashboard queries return data", evidence)  # fmt: skip


def _unresolved_alerts(
    ctx: Context, watched: Mapping[str, Any], alerts: list[dict[str, Any]], faults: list[float]
) -> tuple[list[str], int | None]:
    """The alerts still firing when the duration ended that no fault explains, and how many firing spans had
    ended by then. An alert over a range (``increase(x[15m])``) may outlast its cause by that range; any
    other (a gauge held ``for:`` a while) must have resolved once the faults were healed."""
    finish = [o.start for o in ctx.of("finish", "ok") if o.process == "harness"]
    windows, interval = watched.get("windows"), float(watched.get("interval") or 0.0)
    if not finish or windows is None:  # a history from before the harness recorded them
        return [], None
    end = finish[0]
    unresolved, resolved = [], 0
    for a in alerts:
        if float(a["last"]) < end - 2.0 * interval:
            resolved += 1
            continue
        window = float(windows.get(a["alert"], 0.0))
        if not any(end - window <= t <= end for t in faults):
            unresolved.append(f"{a['alert']}{{task={a['labels'].get('task', '')}}}")
    return unresolved, resolved


#: Judged only in a soak (its ``run`` record has ``soak``): they need the resource samples and many faults.
SOAK_CHECKERS: dict[str, Callable[[Context, Sequence[Record]], Verdict]] = {
    "resources-bounded": resources_bounded,
    "recoveries-not-slower": recoveries_not_slower,
    "alerts-watched": alerts_watched,  # only when Prometheus watched it (``soak.prometheus``)
}

CHECKERS: dict[str, Callable[[Context], Verdict]] = {
    "faults-injected": faults_injected,
    "durable-commits-kept": durable_commits_kept,
    "no-torn-checkpoint": no_torn_checkpoint,
    "restore-newest": restores_newest,
    "restore-exact": restores_exact,
    "lost-work-bounded": lost_work_bounded,
    "hang-detected": hang_detected,
    "liveness": liveness,
    "final-loss": final_loss,
    "no-leaks": no_leaks,
}


def check_all(records: Sequence[Record], reference: Sequence[Record] | None = None) -> dict[str, Verdict]:
    """Run every checker over ``records`` (and a fault-free ``reference`` history for the loss checker)."""
    ctx = context(records)
    out: dict[str, Verdict] = {}
    soak = bool(ctx.run.get("soak"))
    for name, checker in CHECKERS.items():
        if soak and checker is final_loss:
            continue  # a soak ends at a step drawn from its duration: no fault-free run of it to compare with
        out[name] = final_loss(ctx, reference) if checker is final_loss else checker(ctx)
    if soak:
        for name, soak_checker in SOAK_CHECKERS.items():
            if soak_checker is alerts_watched and not (ctx.run.get("soak") or {}).get("prometheus"):
                continue
            out[name] = soak_checker(ctx, records)
    return out


def overall(verdicts: Mapping[str, Verdict]) -> Status:
    """Invalid if any is; valid if all are; unknown otherwise."""
    statuses = {v.status for v in verdicts.values()}
    if "invalid" in statuses:
        return "invalid"
    return "valid" if statuses == {"valid"} else "unknown"
