"""What a checkpoint policy costs: an expected-value simulation of a job running under it.

:func:`simulate` runs the real decision engine on a virtual clock: a step every ``step_time``; a capture blocks
training ``stall`` seconds; a durable save stays in flight ``persist`` seconds more; a new base is folded off the
training path. Failures arrive every ``mtbf`` seconds on average, are fed to the policy, and cost in expectation
the work since the tier's last restorable point. Per tier it reports the saves, their stall, the expected lost
work and the overhead, next to the Young/Daly optimum ``tau = sqrt(2 * stall * mtbf)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from psguard.config import format_duration
from psguard.handoff.contract import Tier
from psguard.policy.engine import SaveContext, Schedule, young_daly_interval

_BASE_BYTES = 1_000_000  # units for the chain-size rule; only ratios matter


#: Longest job simulated: ten years. Past that the answer is no more useful and the run would never end.
MAX_DURATION = 10 * 365 * 86400.0
#: Most policy decisions one simulation makes (about a minute of CPU): a policy that saves every few steps
#: over a long duration is refused with a message, not simulated for hours.
MAX_DECISIONS = 300_000


@dataclass(frozen=True)
class Job:
    """The job being simulated: failure rate, save costs, how long it runs and how fast it steps."""

    mtbf: float
    stall: float
    persist: float
    duration: float
    step_time: float = 0.02
    delta_percent: float = 2.0  # size of each durable delta as a share of the base's bytes

    def __post_init__(self) -> None:
        for name in ("mtbf", "duration", "step_time"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("stall", "persist", "delta_percent"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.duration > MAX_DURATION:
            raise ValueError(f"duration must be at most {MAX_DURATION / 86400:.0f} days (a simulation runs every step)")

    @property
    def failures(self) -> float:
        """Expected number of failures over the duration."""
        return self.duration / self.mtbf


@dataclass(frozen=True)
class TierResult:
    """One tier's numbers. Lost work and overhead are ``None`` for the base tier (not a restore point)."""

    tier: str
    saves: int
    mean_interval: float | None
    stall: float
    lost_per_failure: float | None
    lost_total: float | None
    overhead_percent: float | None


@dataclass(frozen=True)
class SimResult:
    """Everything :func:`simulate` found; ``save_times`` (tier -> decision times) feeds the plot."""

    job: Job
    tiers: tuple[TierResult, ...]
    captures: int
    total_stall: float
    optimum: dict[str, dict[str, float]]
    save_times: dict[str, tuple[float, ...]]

    def tier(self, name: str) -> TierResult:
        return next(t for t in self.tiers if t.tier == name)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (save times left out)."""
        return {
            "job": asdict(self.job) | {"expected_failures": self.job.failures},
            "captures": self.captures,
            "total_stall": self.total_stall,
            "stall_percent": 100.0 * self.total_stall / self.job.duration,
            "tiers": {t.tier: {k: v for k, v in asdict(t).items() if k != "tier"} for t in self.tiers},
            "young_daly_optimum": self.optimum,
        }


def _expected_loss(points: Sequence[tuple[float, float]], duration: float) -> float:
    """Mean work lost by a failure at a uniform moment in [0, duration].

    ``points`` are (restorable at, state taken at) pairs: a failure at ``t`` restores the newest checkpoint
    restorable by ``t`` and loses ``t`` minus the time its state was taken. Before the first one, the job
    restarts from its initial state (time 0).
    """
    marks = sorted([(0.0, 0.0), *(p for p in points if p[0] < duration)])
    total = 0.0
    for (ready, taken), (nxt, _) in zip(marks, [*marks[1:], (duration, 0.0)], strict=True):
        total += ((nxt - taken) ** 2 - (ready - taken) ** 2) / 2.0
    return total / duration


def _cost(interval: float, job: Job, persist: float) -> dict[str, float]:
    saves = job.duration / interval
    lost = interval / 2.0 + persist
    return {
        "interval": interval,
        "saves": saves,
        "stall": saves * job.stall,
        "lost_per_failure": lost,
        "lost_total": job.failures * lost,
        "overhead_percent": 100.0 * (job.stall / interval + lost / job.mtbf),
    }


def optimum(job: Job) -> dict[str, dict[str, float]]:
    """The Young/Daly interval and its cost (first-order model) for the memory and durable tiers."""
    tau = young_daly_interval(job.stall, job.mtbf) if job.stall > 0 else job.step_time
    return {
        "memory": _cost(max(tau, job.step_time), job, 0.0),
        "durable": _cost(max(tau, job.persist, job.step_time), job, job.persist),
    }


@dataclass
class _Trace:
    """What a schedule did over a job: when each tier saved, and when each state became restorable."""

    saves: dict[Tier, list[float]] = field(default_factory=lambda: {t: [] for t in Tier})
    #: Per tier: (when restorable, the time of the state it restores).
    restorable: dict[Tier, list[tuple[float, float]]] = field(
        default_factory=lambda: {Tier.MEMORY: [], Tier.DURABLE: []}
    )
    captures: int = 0
    total_stall: float = 0.0


def _run(schedule: Schedule, job: Job) -> _Trace:
    """Ask ``schedule`` after every step (or when its hint says) on a virtual clock, failures every MTBF."""
    context = SaveContext(started_at=0.0, observed_since=0.0, base_bytes=_BASE_BYTES)
    now, step = 0.0, 0
    trace = _Trace()
    saves, restorable = trace.saves, trace.restorable
    commit_at: float | None = None
    commit_state = 0.0
    next_failure = job.mtbf
    decisions = 0
    while now < job.duration:
        decisions += 1
        if decisions > MAX_DECISIONS:
            raise ValueError(
                f"this policy decides more than {MAX_DECISIONS} times in the first {now / 86400:.1f} of "
                f"{job.duration / 86400:.1f} days: simulate a shorter duration"
            )
        if commit_at is not None and commit_at <= now:
            restorable[Tier.DURABLE].append((commit_at, commit_state))
            context = replace(context, in_flight=frozenset())
            commit_at = None
        while next_failure <= now:
            context = context.with_failure(next_failure)
            next_failure += job.mtbf
        decision = schedule.decide(step, now, context)
        if decision:
            at = now
            captured = bool(decision.tiers & {Tier.MEMORY, Tier.DURABLE})
            if captured:
                trace.captures += 1
                trace.total_stall += job.stall
                now += job.stall
                restorable[Tier.MEMORY].append((now, at))
            for tier in decision.tiers:
                saves[tier].append(at)
            if Tier.DURABLE in decision.tiers:
                commit_at, commit_state = now + job.persist, at
                context = replace(context, in_flight=frozenset({Tier.DURABLE}))
            context = context.with_save(
                decision.tiers,
                step=step,
                at=at,
                stall=job.stall if captured else None,
                delta_bytes=int(_BASE_BYTES * job.delta_percent / 100.0),
                base_bytes=_BASE_BYTES,
            )
            wait = job.step_time  # the caller decides again after the next step
        else:
            steps_left = None if decision.steps_left is None else decision.steps_left * job.step_time
            committing = None if commit_at is None else commit_at - now
            hints = (decision.seconds_left, steps_left, committing, next_failure - now, job.duration - now)
            wait = min(h for h in hints if h is not None)
        steps = max(1, math.ceil(wait / job.step_time - 1e-9))
        step += steps
        now += steps * job.step_time
    if commit_at is not None:
        restorable[Tier.DURABLE].append((commit_at, commit_state))
    return trace


def simulate(schedule: Schedule, job: Job) -> SimResult:
    """Run ``schedule`` over ``job`` on a virtual clock (see the module doc) and measure, per tier, its saves,
    their mean interval and stall, and the work a failure loses on average and in all."""
    trace = _run(schedule, job)
    rows: list[TierResult] = []
    for tier in Tier:
        times = trace.saves[tier]
        mean = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        stall = len(times) * job.stall if tier is not Tier.BASE else 0.0
        lost = _expected_loss(trace.restorable[tier], job.duration) if tier in trace.restorable else None
        total = None if lost is None else lost * job.failures
        overhead = None if total is None else 100.0 * (stall + total) / job.duration
        rows.append(TierResult(tier.value, len(times), mean, stall, lost, total, overhead))
    return SimResult(
        job=job,
        tiers=tuple(rows),
        captures=trace.captures,
        total_stall=trace.total_stall,
        optimum=optimum(job),
        save_times={t.value: tuple(v) for t, v in trace.saves.items()},
    )


def _d(seconds: float | None) -> str:
    return "-" if seconds is None else format_duration(seconds)


def format_report(result: SimResult, title: str = "") -> str:
    """The table ``psguard policy simulate`` prints."""
    job = result.job
    lines = [
        f"{title + ': ' if title else ''}MTBF {_d(job.mtbf)}, stall {_d(job.stall)}/save, persist {_d(job.persist)},"
        f" {_d(job.duration)} at {_d(job.step_time)}/step; expected failures {job.failures:.1f}",
        "",
        f"{'tier':8} {'saves':>8} {'interval':>9} {'stall':>9} {'lost/failure':>13} {'lost total':>11} {'overhead':>9}",
    ]
    for t in result.tiers:
        overhead = "-" if t.overhead_percent is None else f"{t.overhead_percent:.2f}%"
        lines.append(
            f"{t.tier:8} {t.saves:>8} {_d(t.mean_interval):>9} {_d(t.stall):>9} {_d(t.lost_per_failure):>13}"
            f" {_d(t.lost_total):>11} {overhead:>9}"
        )
    stall_pct = 100.0 * result.total_stall / job.duration
    lines += [
        "",
        f"captures {result.captures}, total stall {_d(result.total_stall)} ({stall_pct:.2f}% of the run);"
        " overhead = the tier's stall + its lost work (memory includes every capture: the whole job's overhead)",
        f"Young/Daly optimum: tau = sqrt(2 x {_d(job.stall)} x {_d(job.mtbf)})"
        f" = {_d(result.optimum['memory']['interval'])}",
    ]
    for name, opt in result.optimum.items():
        mine = result.tier(name)
        vs = "" if mine.overhead_percent is None else f" (this policy: {mine.overhead_percent:.2f}%)"
        lines.append(
            f"  {name:8} every {_d(opt['interval'])}: {opt['saves']:.0f} saves, stall {_d(opt['stall'])},"
            f" lost/failure {_d(opt['lost_per_failure'])}, overhead {opt['overhead_percent']:.2f}%{vs}"
        )
    return "\n".join(lines)


def plot(result: SimResult, path: str | Path, title: str = "") -> None:
    """Write a PNG: overhead against interval (with the Young/Daly optimum and this policy's tiers marked),
    and the saves of each tier over time."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    job = result.job
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    tau = result.optimum["memory"]["interval"]
    lo = max(job.step_time, min(tau, *(t.mean_interval or tau for t in result.tiers)) / 20)
    hi = max(tau, *(t.mean_interval or tau for t in result.tiers)) * 20
    xs = [lo * (hi / lo) ** (i / 199) for i in range(200)]
    for name, persist, colour in (("memory", 0.0, "tab:blue"), ("durable", job.persist, "tab:orange")):
        ys = [100.0 * (job.stall / x + (x / 2 + persist) / job.mtbf) for x in xs]
        left.plot(xs, ys, color=colour, label=f"{name}: stall/τ + (τ/2{' + persist' if persist else ''})/MTBF")
        mine = result.tier(name)
        if mine.mean_interval is not None and mine.overhead_percent is not None:
            left.scatter([mine.mean_interval], [mine.overhead_percent], color=colour, zorder=3, label=f"{name}: policy")
    left.axvline(tau, color="grey", linestyle="--", label=f"Young/Daly τ = {format_duration(tau)}")
    left.set(xscale="log", yscale="log", xlabel="checkpoint interval (s)", ylabel="overhead (% of run time)")
    left.set_title("overhead vs interval")
    left.legend(fontsize=7)
    scale, unit = (86400.0, "days") if job.duration >= 2 * 86400 else (3600.0, "hours")
    for name, times in result.save_times.items():
        if times:
            right.step([t / scale for t in times], range(1, len(times) + 1), where="post", label=name)
    right.set(xlabel=f"time ({unit})", ylabel="saves so far", yscale="log", title="saves per tier")
    right.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.savefig(str(path), dpi=100)
