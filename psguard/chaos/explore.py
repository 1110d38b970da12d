"""``psguard chaos explore``: scenarios drawn from a seed, run on psguard and on plain TF, judged side by side.

The scenarios in ``chaos/`` are cases somebody chose, and an async checkpointer's bugs hide in the cases nobody
chose: a cadence that happens to suit this machine's store, a fault during the first base write. Here every case
is *drawn*, as FoundationDB's simulations and TigerBeetle's VOPR draw theirs: from ``(seed, index)`` come the
job's size, the cluster, the storage, the cadences, peer copies, and one to three faults at drawn moments (a
step, optionally "while a durable commit is in flight" or "while a restore runs"), overlapping when they fall
close. The ``full`` space widens each case from a second stream of ``(seed, index)`` (:class:`Widening`): faults
during the persister's first base, a persist, its compaction or its gc; a GCS store; HTTP 5xx answers from an
object store; parity blocks as peer copies; a durable cron cadence; retention; pauses longer than the probe's
``hung_after`` (a freeze psguard restarts where TF waits). Drawn apart, the first stream's fields draw as they
always did (the ``ci`` space, which widens nothing, draws its old cases exactly; ``full-v1`` is the full space
unwidened and ``full-v2`` the full space before long pauses, where a case found before each widening replays). The same
``(seed, index)`` gives the same case on any machine (:func:`draw_case`), so a failing case replays with ``--seed
S --case I``.

Each case runs twice, on psguard and on the plain-TF practice (:mod:`psguard.chaos.baseline`: the same faults at
the same steps, a synchronous ``tf.train.CheckpointManager`` save at the durable cadence, the whole job restarted
on any failure), and is judged by every checker of the psguard run (plain TF's run is the reference for the final
loss: same data, same seed, same target step) plus :func:`not_worse_than_tf`: per fault that TF recovered from
by restoring, psguard lost no more steps than TF (one chunk of slack: a fault fires at the first reported step at
or past its trigger, so the two runs see it up to a chunk apart); per fault TF waited out (a pause: TF has no
probe, so it restores nothing and loses no step, only the pause's time), psguard was back at normal speed within
a restart's cost of TF; and its goodput over the run is at least TF's (within ``goodput_tolerance``: two runs on
a shared two-core machine). A failing case is shrunk (:func:`shrink`): faults
dropped one by one, the state halved, fewer workers, no peer copies, a local store, while it still fails the same
checkers, so the report names the smallest case that shows the bug. A case whose fault waited for a moment that
never came while the run lasted (a durable commit after its step, a compaction, ...) did not run as drawn: it is
listed as ``missed: <moment>`` and counted apart from the invalid cases (:class:`CaseResult`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, cast

from psguard.chaos.checkers import Verdict, check_all, missed_moments, overall
from psguard.chaos.history import read_history
from psguard.chaos.outcomes import STORE_OUTAGES
from psguard.chaos.scenario import (
    PROXIED_STORES,
    Action,
    Checks,
    ClusterSpec,
    Fault,
    Scenario,
    StorageSpec,
    TrainingSpec,
)

__all__ = [
    "SPACES",
    "CaseResult",
    "Space",
    "Widening",
    "draw_case",
    "explore",
    "not_worse_than_tf",
    "run_case",
    "shrink",
]

#: Bytes of state per embedding cell: the table and its Adagrad accumulator, float32 each (the demo job's model).
_STATE_BYTES_PER_CELL = 8


@dataclass(frozen=True)
class Widening:
    """What a space draws beyond its first dimensions, each from a second random stream of ``(seed, index)`` (the
    first stream's draws stay as they were) and each only where the case makes it possible: the chances are per
    case, or per fault for a fault's moment and a store fault's kind."""

    moment: float = 0.0  # a fault drawn without a moment waits for one of the chief agent's persister...
    moments: tuple[str, ...] = ("first-base", "persist", "compaction", "gc")  # ... one of these (AGENT_MOMENTS)
    gcs: float = 0.0  # an S3 store drawn is a GCS one (its emulator)
    store_errors: float = 0.0  # a store fault drawn on S3 or GCS is HTTP 5xx answers instead (500 or 503)
    parity: float = 0.0  # peer copies drawn (3 PS or more) are parity blocks
    cron: float = 0.0  # the durable cadence also follows a cron of every N seconds, N one of cron_seconds
    cron_seconds: tuple[int, ...] = (10, 15, 20, 30)
    retention: float = 0.0  # the trainer keeps the newest 1-3 checkpoints (a gc after each commit past them)
    # A pause drawn lasts past the probe's hung_after (10 s by default): a freeze worth a restart, where TF waits.
    long_pause: float = 0.0
    long_pause_s: tuple[float, float] = (12.0, 30.0)


#: Nothing widened: a space's first dimensions only.
NO_WIDENING = Widening()


@dataclass(frozen=True)
class Space:
    """Where cases are drawn from: the settings users run, bounded for the machine the exploration runs on."""

    ps: tuple[int, int] = (1, 2)
    workers: tuple[int, int] = (1, 2)
    state_mb: tuple[float, float] = (1.0, 16.0)  # embedding table + slot, drawn log-uniform
    dims: tuple[int, ...] = (8, 16, 32)
    steps: int = 150
    chunk: int = 5
    storages: tuple[Literal["local", "s3", "hdfs"], ...] = ("local", "s3")
    memory_every: tuple[int, ...] = (5, 10)
    durable_multiple: tuple[int, int] = (1, 6)  # durable cadence = memory cadence x this
    faults: tuple[int, int] = (1, 2)
    time_limit: float = 360.0
    goodput_tolerance: float = 0.15
    widening: Widening = NO_WIDENING


_FULL = Space(
    ps=(1, 4),
    state_mb=(1.0, 256.0),
    steps=300,
    storages=("local", "s3", "hdfs"),
    memory_every=(5, 10, 25),
    faults=(1, 3),
    time_limit=900.0,
)
_WIDE = Widening(moment=0.35, gcs=0.5, store_errors=0.35, parity=0.5, cron=0.25, retention=0.15)
#: ``ci``: a case in a couple of minutes (both runs); ``full``: what ``make explore`` draws from; ``full-v1`` and
#: ``full-v2``: the full space before each widening, to replay a case found then (``--space full-v1 --seed S --case
#: I``): v1 before the second stream, v2 before long pauses.
SPACES: dict[str, Space] = {
    "ci": Space(),
    "full": replace(_FULL, widening=replace(_WIDE, long_pause=0.4)),
    "full-v1": _FULL,
    "full-v2": replace(_FULL, widening=_WIDE),
}

#: Task faults and how often each is drawn (a node loss, a process kill and a freeze are what the field reports).
_TASK_FAULTS: tuple[tuple[str, float], ...] = (
    ("kill", 3.0),
    ("kill-agent", 2.0),  # the node: the agent and its task (and the memory tier it held)
    ("terminate", 1.0),
    ("pause", 1.0),
    ("partition", 1.0),  # a PS cut off from the chief and workers (TCP proxy)
)
#: Store faults, drawn only with a store server (s3, hdfs; ``delay`` of the store only on s3).
_STORE_FAULTS: tuple[tuple[str, float], ...] = (("storage-outage", 1.0), ("delay", 0.5))


def _pick(rng: random.Random, weighted: Sequence[tuple[str, float]]) -> str:
    return rng.choices([w[0] for w in weighted], [w[1] for w in weighted])[0]


def _draw_fault(
    rng: random.Random, space: Space, cluster: ClusterSpec, storage: str, first: int, *, restores: bool
) -> Fault:
    """One fault; ``restores``: an earlier fault may start a restore, so "during a restore" can happen."""
    store_faults = [f for f in _STORE_FAULTS if storage != "local" and (f[0] != "delay" or storage == "s3")]
    action = cast(Action, _pick(rng, [*_TASK_FAULTS, *store_faults]))
    at_step = rng.randrange(first, int(space.steps * 0.8), space.chunk)
    if action in ("storage-outage", "delay"):
        outage = round(rng.uniform(2.0, 20.0), 1)
        return Fault(action=action, target="store", at_step=at_step, duration=outage, latency=rng.uniform(0.05, 0.5))
    roles = ["ps"] * 3 + ["worker"] + (["chief"] if action in ("kill", "kill-agent", "terminate") else [])
    role = rng.choice(roles if action != "partition" else ["ps"])
    count = {"ps": cluster.ps, "worker": cluster.workers}.get(role, 1)
    target = role if role == "chief" else f"{role}:{rng.randrange(count)}"
    drawn = rng.choices([None, "durable-commit", "restore"], [6, 2, 1 if restores else 0])[0]
    during = cast(Literal["durable-commit", "restore"] | None, drawn)
    if during == "restore" and target == "chief":
        during = "durable-commit"
    return Fault(action=action, target=target, at_step=at_step, duration=round(rng.uniform(1.0, 5.0), 1), during=during)


def draw_case(seed: int, index: int, space: Space = SPACES["ci"]) -> Scenario:
    """Case ``index`` of exploration ``seed``: the same arguments give the same scenario, on any machine."""
    rng = random.Random(f"psguard-explore:{seed}:{index}")
    cluster = ClusterSpec(ps=rng.randint(*space.ps), workers=rng.randint(*space.workers))
    storage = rng.choice(space.storages)
    dim = rng.choice(space.dims)
    low, high = space.state_mb
    state = low * (high / low) ** rng.random()
    vocab = max(1000, int(state * 2**20 / (dim * _STATE_BYTES_PER_CELL)))
    memory_every = rng.choice(space.memory_every)
    durable_every = memory_every * rng.randint(*space.durable_multiple)
    training = TrainingSpec(
        steps=space.steps,
        chunk=space.chunk,
        memory_every=memory_every,
        durable_every=durable_every,
        durable_min_seconds=rng.choice([0.0, 0.0, 0.0, 2.0]),  # sometimes a time floor too, as week-long jobs set
        vocab=vocab,
        dim=dim,
    )
    first = 2 * space.chunk  # after the first capture: a fault before any save is not a checkpointer's case
    faults: list[Fault] = []
    for _ in range(rng.randint(*space.faults)):
        faults.append(_draw_fault(rng, space, cluster, storage, first, restores=bool(faults)))
    faults.sort(key=lambda f: f.at_step or 0)
    if faults[0].during == "restore":  # drawn after a fault that restores, but it fires first: nothing to wait for
        faults[0] = replace(faults[0], during=None)
    several_ps = cluster.ps > 1  # a peer copy lives on another PS node; keeping survivors needs one to survive
    drawn = Scenario(
        name=f"explore-{seed}-{index}",
        proves=f"drawn case {index} of seed {seed}: psguard is never worse than plain TF under its faults",
        time_limit=space.time_limit,
        cluster=cluster,
        storage=StorageSpec(kind=storage),
        training=training,
        faults=tuple(faults),
        checks=Checks(reference=False),
        peer_copies=several_ps and rng.random() < 0.3,
        keep_survivors=several_ps and rng.random() < 0.2,
    )
    if space.widening == NO_WIDENING:
        return drawn
    return widen(drawn, random.Random(f"psguard-explore:{seed}:{index}:v2"), space.widening)


def widen(case: Scenario, rng: random.Random, w: Widening) -> Scenario:
    """``case`` widened by ``w``, from ``rng`` (the second stream). Every draw is made whether it is used or not,
    in a fixed order (the case's, then each fault's), so that one dimension's draw never moves another's."""
    u_gcs, u_parity, u_cron, u_retain = rng.random(), rng.random(), rng.random(), rng.random()
    cron_seconds, keep, new_base_after = rng.choice(w.cron_seconds), rng.randint(1, 3), rng.randint(1, 3)
    per_fault = [(rng.random(), rng.choice(w.moments), rng.random(), rng.choice((500, 503))) for _ in case.faults]
    pauses = [(rng.random(), round(rng.uniform(*w.long_pause_s), 1)) for _ in case.faults]  # drawn after: v2 stays
    kind = "gcs" if case.storage.kind == "s3" and u_gcs < w.gcs else case.storage.kind
    t = case.training
    training = replace(t, durable_cron=f"* * * * * */{cron_seconds}" if u_cron < w.cron else None)
    faults: list[Fault] = []
    for fault, (u_moment, moment, u_errors, status), (u_long, long_s) in zip(
        case.faults, per_fault, pauses, strict=True
    ):
        if fault.target == "store" and kind in PROXIED_STORES and u_errors < w.store_errors:
            fault = replace(fault, action="store-errors", http_status=status)
        if fault.action == "pause" and u_long < w.long_pause:
            fault = replace(fault, duration=long_s)
        if fault.during is None and u_moment < w.moment:
            fault = _at_moment(fault, moment, training, faults, keep=keep, new_base_after=new_base_after)
            if fault.during == "gc":
                training = replace(training, max_to_keep=keep)
            elif fault.during == "compaction":
                training = replace(training, new_base_after=new_base_after)
        faults.append(fault)
    if training.max_to_keep is None and u_retain < w.retention:
        training = replace(training, max_to_keep=keep)
    faults.sort(key=lambda f: f.at_step or 0)  # a first base's fault moved to the start
    copies = "parity" if case.peer_copies and case.cluster.ps >= 3 and u_parity < w.parity else case.peer_copies
    return replace(case, storage=StorageSpec(kind=kind), training=training, faults=tuple(faults), peer_copies=copies)


def _at_moment(
    fault: Fault, moment: str, t: TrainingSpec, earlier: Sequence[Fault], *, keep: int, new_base_after: int
) -> Fault:
    """``fault`` aimed at the persister's ``moment``, where the case leaves time for that moment to come after the
    fault's step (else ``fault`` as it was): a first base is written once, at the start (the fault moves there);
    a persist comes every durable cadence, a gc after each commit past the ``keep`` newest, a compaction (a new
    base) every ``new_base_after + 1`` commits. Each needs two chances before the job ends; a time floor on the
    durable cadence spaces commits by the clock, so compactions and gcs are not aimed at then."""
    step, every, room = fault.at_step or 0, t.durable_every, t.steps - t.chunk
    if moment == "first-base":
        if any(f.during == "first-base" for f in earlier):
            return fault
        return replace(fault, at_step=None, at_time=0.0, during="first-base")
    if moment == "persist":
        return replace(fault, during="persist") if step + 2 * every <= room else fault
    if t.durable_min_seconds:
        return fault
    if moment == "gc":
        return replace(fault, during="gc") if max(step, keep * every) + 2 * every <= room else fault
    cycle = (new_base_after + 1) * every  # a base, then new_base_after deltas
    next_base = -(-max(step, 1) // cycle) * cycle
    return replace(fault, during="compaction") if next_base + cycle <= room else fault


def describe_case(scenario: Scenario) -> str:
    """One line: what was drawn."""
    t, c = scenario.training, scenario.cluster
    mb = t.vocab * t.dim * _STATE_BYTES_PER_CELL / 2**20
    copies = "parity" if scenario.peer_copies == "parity" else "copies"
    extras = [x for x, on in ((copies, scenario.peer_copies), ("keep", scenario.keep_survivors)) if on]
    extras += [f"retain {t.max_to_keep}"] if t.max_to_keep is not None else []
    extras += [f"new-base/{t.new_base_after}"] if t.new_base_after is not None else []
    cron = t.durable_cron
    if cron is not None:
        cron = f"{cron.rsplit('/', 1)[1]}s" if cron.startswith("* * * * * */") else f"'{cron}'"
    return (
        f"{c.ps} PS, {c.workers} worker(s), {mb:.1f} MB, {scenario.storage.kind}, memory/{t.memory_every} "
        f"durable/{t.durable_every}{f' >={t.durable_min_seconds:g}s' if t.durable_min_seconds else ''}"
        f"{f' cron/{cron}' if cron else ''}"
        f"{' ' + '+'.join(extras) if extras else ''}: " + "; ".join(map(_describe_fault, scenario.faults))
    )


def _describe_fault(fault: Fault) -> str:
    """A fault as the case line names it: a pause's length too when it is a long one (see ``long_pause``)."""
    long = fault.action == "pause" and fault.duration >= Widening.long_pause_s[0]
    return f"{fault.describe()}{f' for {fault.duration:g}s' if long else ''}"


# --------------------------------------------------------------------------------------------- the judgement
#: Seconds a fault plain TF waited out (a pause: nothing to restore) may cost psguard more than TF: psguard's
#: agents replace a task frozen longer than probe.hung_after and restore it, a restart's fixed cost here.
WAITED_OUT_SLACK = 5.0


def _paired(ours: Sequence[Mapping[str, Any]], theirs: Sequence[Mapping[str, Any]]) -> list[tuple[Any, Any]]:
    """Each of psguard's faults with the baseline's same fault: the k-th on a target with the k-th on it (the two
    runs fire a fault at their first reported step at or past its trigger, which may differ by a chunk)."""
    queues: dict[Any, list[Mapping[str, Any]]] = {}
    for f in theirs:
        queues.setdefault(f.get("target"), []).append(f)
    return [(f, queues[f.get("target")].pop(0) if queues.get(f.get("target")) else None) for f in ours]


def _during_store_outage(fault: Mapping[str, Any]) -> bool:
    """Whether a store outage (:data:`~psguard.chaos.outcomes.STORE_OUTAGES`) overlapped ``fault`` in its run."""
    return any(o.split(" ")[0] in STORE_OUTAGES and o.endswith(" store") for o in fault.get("overlaps_with") or ())


def _tf_could_lose(ours: Mapping[str, Any], tf: Mapping[str, Any], baseline: Mapping[str, Any]) -> int:
    """The steps plain TF lost to the fault, or would have lost had it struck where psguard's did: the two runs
    meet a fault aimed at a moment of psguard's persister (a compaction, a gc) at different steps (TF has no such
    moment: its fault fires at its step), and what a restore loses is the distance to the newest save before the
    fault. TF's saves are those its run had acknowledged (``durable_lag.committed_steps``): its cadence as it ran."""
    lost = int(tf["lost_steps"])
    saves = (baseline.get("durable_lag") or {}).get("committed_steps")
    if ours.get("restored_step") is None or not saves:
        return lost
    struck = int(ours["restored_step"]) + int(ours["lost_steps"])  # the step psguard's run had reached
    newest = max((s for s in saves if s <= struck), default=0)
    return max(lost, struck - newest)


def not_worse_than_tf(
    ours: Mapping[str, Any], baseline: Mapping[str, Any], *, chunk: int, goodput_tolerance: float
) -> Verdict:
    """psguard's run against plain TF's on the same case (``report.json`` of each; see the module doc).

    Per fault: where TF restored from its checkpoint, psguard lost at most TF's steps (or what TF's saves would
    have lost at the step psguard's fault struck, :func:`_tf_could_lose`) plus a chunk; where TF
    restored nothing (it waited the fault out: a pause), psguard was back at normal speed at most
    :data:`WAITED_OUT_SLACK` seconds after TF (its lost steps are part of that time). A fault psguard never
    recovered from while TF did is invalid; one TF never recovered from is psguard's to win. A fault that met a
    store outage is judged in time, not steps: psguard trains through the outage where TF's saves fail and it
    stands still, so the extra steps it may lose are steps TF never made; goodput decides. Over the run, its
    goodput is at least TF's, within ``goodput_tolerance``."""
    name = "not-worse-than-tf"
    rows: list[dict[str, Any]] = []
    worse: list[dict[str, Any]] = []
    for f, tf in _paired(ours.get("faults", []), baseline.get("faults", [])):
        row = {"fault": f"{f.get('fault')} {f.get('target')} at step {f.get('at_step')}",
               "psguard_lost": f.get("lost_steps"), "tf_lost": tf.get("lost_steps") if tf else None,
               "psguard_recovery_s": f.get("recovery_seconds"),
               "tf_recovery_s": tf.get("recovery_seconds") if tf else None}  # fmt: skip
        rows.append(row)
        if tf is None or tf.get("lost_steps") is None:
            continue  # not injected on TF (it has no agent to pause), or TF never recovered
        if f.get("lost_steps") is None:
            worse.append({**row, "why": "psguard never recovered from a fault plain TF recovered from"})
        elif tf.get("restored_step") is None:
            ours_s, tf_s = f.get("recovery_seconds"), tf.get("recovery_seconds")
            if ours_s is not None and tf_s is not None and ours_s > tf_s + WAITED_OUT_SLACK:
                worse.append({**row, "why": f"back to normal speed {ours_s - tf_s:.1f}s after plain TF, which "
                                            f"waited the fault out (slack {WAITED_OUT_SLACK:g}s)"})  # fmt: skip
        elif f["lost_steps"] > tf["lost_steps"] + chunk and _during_store_outage(f):
            # psguard trained through the outage (its memory tier kept those steps restorable) where TF's saves
            # failed and it stood still: the steps this fault cost are steps TF never made. Goodput judges it.
            row["judged_by"] = "goodput: psguard trained through a store outage that stopped plain TF"
        elif f["lost_steps"] > _tf_could_lose(f, tf, baseline) + chunk:
            worse.append({**row, "why": f"lost more steps than plain TF (+{chunk} for the fault's moment)"})
    ours_rate = (ours.get("goodput") or {}).get("steps_per_second")
    tf_rate = (baseline.get("goodput") or {}).get("steps_per_second")
    ratio = ours_rate / tf_rate if ours_rate and tf_rate else None
    goodput = {"psguard": ours_rate, "tf": tf_rate, "ratio": ratio, "tolerance": goodput_tolerance}
    if tf_rate and not ours_rate:
        worse.append({"why": "psguard never reached its target; plain TF did", "goodput": goodput})
    elif ratio is not None and ratio < 1.0 - goodput_tolerance:
        worse.append({"why": f"goodput {ratio:.2f}x plain TF's", "goodput": goodput})
    evidence = {"faults": rows, "goodput": goodput, "worse": worse}
    if worse:
        return Verdict(name, "invalid", f"worse than plain TF: {worse[0]['why']} ({len(worse)} finding(s))", evidence)
    if ratio is None:
        return Verdict(name, "unknown", "no goodput to compare (a run did not finish)", evidence)
    return Verdict(name, "valid", f"no fault cost more than on plain TF; goodput {ratio:.2f}x plain TF's", evidence)


@dataclass
class CaseResult:
    """One case's outcome: every verdict (psguard's checkers and ``not-worse-than-tf``) and where its runs are.

    ``missed``: the moments a fault of the case waited for and never met (a durable commit, a compaction, ... that
    did not come while the run lasted), on psguard's side or plain TF's (``(plain TF)``). Such a case did not run
    as drawn: its ``overall`` is ``missed``, counted apart from the invalid cases, and neither its faults-injected
    verdict (nothing failed but the moment) nor the comparison with plain TF (the two sides met different faults)
    is a finding; psguard's other checkers still are."""

    seed: int
    index: int
    scenario: Scenario
    directory: Path
    verdicts: dict[str, Verdict]
    seconds: float
    missed: list[str] = dataclasses.field(default_factory=list)

    @property
    def invalid(self) -> list[str]:
        not_findings = {"faults-injected", "not-worse-than-tf"} if self.missed else set()
        return sorted(n for n, v in self.verdicts.items() if v.status == "invalid" and n not in not_findings)

    @property
    def overall(self) -> str:
        if self.invalid:
            return "invalid"
        return "missed" if self.missed else overall(self.verdicts)

    @property
    def verdict(self) -> str:
        """The case's verdict as the summary says it: ``missed: <moment>``, or the overall and what was invalid."""
        if self.overall == "missed":
            return "missed: " + ", ".join(self.missed)
        return f"{self.overall}{' ' + ','.join(self.invalid) if self.invalid else ''}"

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "index": self.index,
            "case": describe_case(self.scenario),
            "scenario": dataclasses.asdict(self.scenario),
            "directory": str(self.directory),
            "overall": self.overall,
            "invalid": self.invalid,
            "missed": self.missed,
            "verdicts": {n: {"status": v.status, "summary": v.summary} for n, v in self.verdicts.items()},
            "seconds": round(self.seconds, 1),
        }


def run_case(
    scenario: Scenario,
    directory: Path,
    *,
    seed: int,
    index: int,
    goodput_tolerance: float,
    say: Callable[[str], None] = print,
) -> CaseResult:
    """Run one case on psguard and on plain TF (:func:`psguard.chaos.baseline.run_side_by_side`) and judge it."""
    from psguard.chaos.baseline import run_side_by_side

    t0 = time.monotonic()
    result = run_side_by_side(scenario, directory, seed=seed, say=say)
    # Plain TF's run is the reference for the final loss: the same data and seed, trained to the same step.
    ours = read_history(directory / "psguard" / "history.jsonl")
    verdicts = check_all(ours, reference=read_history(directory / "baseline" / "history.jsonl"))
    verdicts["not-worse-than-tf"] = not_worse_than_tf(
        result.report,
        result.report["baseline"],
        chunk=scenario.training.chunk,
        goodput_tolerance=goodput_tolerance,
    )
    tf_injected = result.report["baseline"]["verdicts"].get("faults-injected")
    missed = missed_moments(verdicts["faults-injected"])
    if tf_injected is not None:
        missed += [f"{m} (plain TF)" for m in missed_moments(Verdict("faults-injected", **tf_injected))]
    case = CaseResult(seed, index, scenario, directory, verdicts, time.monotonic() - t0, missed)
    (directory / "case.json").write_text(json.dumps(case.to_json(), indent=2, default=str))
    return case


# --------------------------------------------------------------------------------------------- shrinking
def _without_fault(scenario: Scenario, i: int) -> Scenario:
    return replace(scenario, faults=scenario.faults[:i] + scenario.faults[i + 1 :])


def smaller(scenario: Scenario) -> Iterator[Scenario]:
    """Valid cases one step smaller than ``scenario``, most promising first (fewer faults, then less of all)."""
    faults = scenario.faults
    t, c = scenario.training, scenario.cluster
    steps: list[Callable[[], Scenario]] = []
    if len(faults) > 1:
        steps += [functools.partial(_without_fault, scenario, i) for i in range(len(faults))]
    if t.vocab >= 2000:
        steps.append(lambda: replace(scenario, training=replace(t, vocab=t.vocab // 2)))
    if scenario.peer_copies:
        steps.append(lambda: replace(scenario, peer_copies=False))
    if scenario.keep_survivors:
        steps.append(lambda: replace(scenario, keep_survivors=False))
    if c.workers > 1:
        steps.append(lambda: replace(scenario, cluster=replace(c, workers=1)))
    if c.ps > 1:
        steps.append(lambda: replace(scenario, cluster=replace(c, ps=c.ps - 1)))
    if scenario.storage.kind != "local":
        steps.append(lambda: replace(scenario, storage=StorageSpec(kind="local")))
    if any(f.during is not None for f in faults):
        steps.append(lambda: replace(scenario, faults=tuple(replace(f, during=None) for f in faults)))
    if t.durable_cron is not None:
        steps.append(lambda: replace(scenario, training=replace(t, durable_cron=None)))
    if t.max_to_keep is not None:  # refused while a fault waits for a gc: dropped with its moment first
        steps.append(lambda: replace(scenario, training=replace(t, max_to_keep=None)))
    if t.new_base_after is not None:
        steps.append(lambda: replace(scenario, training=replace(t, new_base_after=None)))
    for make in steps:
        try:
            yield make()
        except ValueError:  # e.g. a fault aimed at the task a smaller cluster has not
            continue


def shrink(
    scenario: Scenario,
    still_fails: Callable[[Scenario], bool],
    *,
    attempts: int = 12,
    say: Callable[[str], None] = print,
) -> tuple[Scenario, int]:
    """The smallest case reachable from ``scenario`` by :func:`smaller` steps that ``still_fails`` (greedy: the
    first smaller case that fails is taken, then its smaller ones are tried). Returns it and the runs spent."""
    runs = 0
    current = scenario
    progress = True
    while progress and runs < attempts:
        progress = False
        for candidate in smaller(current):
            runs += 1
            say(f"shrink: trying {describe_case(candidate)}")
            if still_fails(candidate):
                current, progress = candidate, True
                break
            if runs >= attempts:
                break
    return current, runs


# --------------------------------------------------------------------------------------------- exploring
def explore(
    seed: int,
    directory: Path,
    *,
    space: Space,
    cases: int | None = None,
    budget_seconds: float | None = None,
    start: int = 0,
    do_shrink: bool = False,
    say: Callable[[str], None] = print,
) -> list[CaseResult]:
    """Cases ``start``, ``start + 1``, ... of ``seed`` until ``cases`` ran or ``budget_seconds`` passed (a case
    started runs to its end). Each case's line goes to ``cases.jsonl``; a summary to ``summary.md``."""
    if cases is None and budget_seconds is None:
        raise ValueError("give a number of cases, a time budget or both")
    directory.mkdir(parents=True, exist_ok=True)
    results: list[CaseResult] = []
    t0 = time.monotonic()
    index = start
    while (cases is None or len(results) < cases) and (
        budget_seconds is None or time.monotonic() - t0 < budget_seconds
    ):
        scenario = draw_case(seed, index, space)
        say(f"case {index} (seed {seed}): {describe_case(scenario)}")
        case = run_case(
            scenario, directory / f"case-{index}", seed=seed, index=index,
            goodput_tolerance=space.goodput_tolerance, say=_indent(say),
        )  # fmt: skip
        results.append(case)
        line = case.to_json()
        if case.invalid and do_shrink:
            line["shrunk"] = _shrink_case(case, directory, space, say)
        with open(directory / "cases.jsonl", "a") as f:
            f.write(json.dumps(line, default=str) + "\n")
        say(f"case {index}: {case.verdict}")
        index += 1
    (directory / "summary.md").write_text(summary(results, seed, space))
    return results


def _shrink_case(case: CaseResult, directory: Path, space: Space, say: Callable[[str], None]) -> dict[str, Any]:
    failing = set(case.invalid)
    attempt = 0

    def still_fails(candidate: Scenario) -> bool:
        nonlocal attempt
        attempt += 1
        again = run_case(
            candidate, directory / f"case-{case.index}-shrink-{attempt}", seed=case.seed, index=case.index,
            goodput_tolerance=space.goodput_tolerance, say=_indent(_indent(say)),
        )  # fmt: skip
        return bool(failing & set(again.invalid))

    smallest, runs = shrink(case.scenario, still_fails, say=_indent(say))
    say(f"case {case.index}: shrunk in {runs} run(s) to: {describe_case(smallest)}")
    return {"case": describe_case(smallest), "scenario": dataclasses.asdict(smallest), "runs": runs}


def _indent(say: Callable[[str], None]) -> Callable[[str], None]:
    return lambda line: say("  " + line)


def summary(results: Sequence[CaseResult], seed: int, space: Space = SPACES["ci"]) -> str:
    """``summary.md``: every case, what it drew and how it was judged; failing cases with their replay command."""
    invalid = [r for r in results if r.invalid]
    missed = [r for r in results if r.overall == "missed"]
    lines = [f"# psguard chaos explore, seed {seed}: {len(results)} case(s), {len(invalid)} invalid, "
             f"{len(missed)} missed", ""]  # fmt: skip
    lines += ["| case | drawn | verdict | not-worse-than-tf | s |", "| --- | --- | --- | --- | --- |"]
    for r in results:
        nw = r.verdicts.get("not-worse-than-tf")
        lines.append(
            f"| {r.index} | {describe_case(r.scenario)} | {r.verdict} | {nw.summary if nw else '-'} | {r.seconds:.0f} |"
        )
    if missed:
        lines += ["", "A missed case did not run as drawn: a fault's moment did not come while the run lasted (not a "
                  "finding; replay it, or draw more cases)."]  # fmt: skip
    if invalid or missed:
        named = next((f"--space {n} " for n, s in SPACES.items() if s == space), "")  # a case is its space's
        lines += ["", f"Replay a case: `psguard chaos explore {named}--seed {seed} --case INDEX` (add `--shrink`)."]
    return "\n".join(lines) + "\n"
