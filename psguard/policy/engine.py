"""When to save, to which tier, and what to keep: psguard's checkpoint decision engine.

The trainer-side ``CheckpointManager`` asks after each step ``schedule.decide(step, now, context)``, saves the
decision's tiers when it says so, updates the context with :meth:`SaveContext.with_save`, and logs the reason.
:class:`Schedule` holds one save policy per tier: **memory** (the sidecar's snapshot), **durable** (the log; a
durable save also refreshes memory) and **base** (fold the delta chain into a new full base). Each policy is a
small frozen dataclass behind :class:`SavePolicy`, composable with :class:`AnyOf`, and every answer is a
:class:`Verdict` with a reason. Saves never overlap, except the urgent one after a preemption signal. Time is the
``now`` the caller passes: nothing here reads a clock. :class:`Retention` says which checkpoints to keep.
"""

from __future__ import annotations

import bisect
import dataclasses
import datetime
import functools
import logging
import math
import time
import zoneinfo
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol, runtime_checkable

from croniter import CroniterBadDateError, croniter

from psguard.codec.strict_json import fields_json
from psguard.config import Check, Duration, format_duration, invalid, validate
from psguard.handoff.contract import Tier
from psguard.policy.lag import LagBound
from psguard.store.durable import BaseRule, ChainState
from psguard.store.retention import Candidate, select_kept

#: The engine's public names, and with :mod:`~psguard.policy.lag`'s the ``psguard.policy`` package's (it exports
#: exactly these); helpers other modules import by name (``Cadence``, ``base_rule``, ``cron_problem``) stay out.
__all__ = [
    "AnyOf",
    "ChainLimit",
    "Continuous",
    "Cron",
    "Decision",
    "EveryInterval",
    "EverySteps",
    "OnPreemption",
    "Retention",
    "SaveContext",
    "SavePolicy",
    "Schedule",
    "TierState",
    "Verdict",
    "YoungDaly",
    "young_daly_interval",
]

logger = logging.getLogger(__name__)

_POSITIVE = Check(lambda v: v > 0, "(> 0)")
_AT_LEAST_ONE = Check(lambda v: v >= 1, "(>= 1)")
_NON_NEGATIVE = Check(lambda v: v >= 0, "(>= 0)")
#: How far ahead a cadence must be able to fire: 400 years, one cycle of the Gregorian calendar (dates and
#: weekdays repeat after it), so a cron expression that matches no time within it matches none ever. Interval
#: cadences longer than this are refused too: a cadence that can never fire would silently never save.
HORIZON_YEARS = 400
HORIZON_SECONDS = HORIZON_YEARS * 365.2425 * 86400
_HORIZON = Check(lambda v: v <= HORIZON_SECONDS, f"(at most {HORIZON_YEARS} years: a longer cadence never fires)")
PositiveDuration = Annotated[Duration, _POSITIVE]
Cadence = Annotated[Duration, _POSITIVE, _HORIZON]
"""An interval between saves: a duration > 0 and within :data:`HORIZON_YEARS`."""
Count = Annotated[int, _AT_LEAST_ONE]


_TIER_ORDER = (Tier.MEMORY, Tier.DURABLE, Tier.BASE)
_EPSILON = 1e-6  # seconds: a time this close to being due is due (callers that jump by hints hit it exactly)


@dataclass(frozen=True)
class TierState:
    """The last save of one tier: its step and its time (``None``: no save yet)."""

    step: int | None = None
    at: float | None = None


@dataclass(frozen=True)
class SaveContext:
    """What the caller knows when it asks for a decision; update it with :meth:`with_save` and
    :meth:`with_failure`. ``started_*``: where counting starts for a tier with no save yet; ``in_flight``: tiers
    whose write has not finished (decisions say no meanwhile, except for preemption); ``recent_stalls`` and
    ``failures`` (with ``observed_since``) feed :class:`YoungDaly`, the chain fields :class:`ChainLimit`."""

    memory: TierState = TierState()
    durable: TierState = TierState()
    base: TierState = TierState()
    started_step: int = 0
    started_at: float | None = None
    in_flight: frozenset[Tier] = frozenset()
    recent_stalls: tuple[float, ...] = ()
    chain_length: int = 0
    delta_bytes: int = 0
    base_bytes: int = 0
    failures: tuple[float, ...] = ()
    observed_since: float | None = None
    preempted_at: float | None = None

    def last(self, tier: Tier) -> TierState:
        """The last save of ``tier``."""
        state: TierState = getattr(self, tier.value)
        return state

    def with_save(
        self,
        tiers: Iterable[Tier],
        *,
        step: int,
        at: float,
        stall: float | None = None,
        delta_bytes: int = 0,
        base_bytes: int | None = None,
    ) -> SaveContext:
        """This context after a save of ``tiers`` at ``step``/``at`` that blocked training ``stall`` s: a durable
        save adds a link of ``delta_bytes`` to the chain, a ``BASE`` save resets it (``base_bytes``: the new base's
        size). ``in_flight`` is left as it is; the last 32 stalls are kept."""
        tiers = frozenset(tiers)
        changes: dict[str, Any] = {t.value: TierState(step, at) for t in tiers}
        if Tier.DURABLE in tiers:
            changes.update(chain_length=self.chain_length + 1, delta_bytes=self.delta_bytes + delta_bytes)
        if Tier.BASE in tiers:
            changes.update(chain_length=0, delta_bytes=0)
            if base_bytes is not None:
                changes["base_bytes"] = base_bytes
        if stall is not None:
            changes["recent_stalls"] = (*self.recent_stalls, stall)[-32:]
        return dataclasses.replace(self, **changes)

    def with_failure(self, at: float) -> SaveContext:
        """This context after a failure of the job observed at ``at``."""
        return dataclasses.replace(self, failures=(*self.failures, at))


@dataclass(frozen=True)
class Verdict:
    """One policy's answer: save or not, why, and (when it is not due) how long until it may be.

    ``seconds_left`` / ``steps_left`` are ``None`` when no amount of time or steps alone makes the policy due
    (e.g. it waits for a signal). A verdict is truthy when it says save.
    """

    save: bool
    reason: str
    seconds_left: float | None = None
    steps_left: int | None = None

    def __bool__(self) -> bool:
        return self.save


@runtime_checkable
class SavePolicy(Protocol):
    """Decides whether one tier should save now.

    ``last`` is the last save of the tier being decided (``context.last(tier)``); ``now`` is the caller's
    clock. Implementations are frozen dataclasses: pure functions of their arguments, no clock of their own.
    """

    def should_save(self, step: int, now: float, *, last: TierState, context: SaveContext) -> Verdict: ...

    def describe(self) -> str:
        """One line saying what the policy does (``every 30s``)."""
        ...


def _since(last: TierState, context: SaveContext) -> tuple[float | None, str]:
    return (last.at, "last save") if last.at is not None else (context.started_at, "start")


def _after(name: str, interval: float, now: float, last: TierState, context: SaveContext, basis: str = "") -> Verdict:
    """Save once ``interval`` seconds have passed since the tier's last save (or the run's start)."""
    since, what = _since(last, context)
    if since is not None and now - since < interval - _EPSILON:
        left = interval - (now - since)
        return Verdict(False, f"{name}: {format_duration(left)} to go{basis}", seconds_left=left)
    head = "no save yet and no start time" if since is None else f"{format_duration(now - since)} since {what}"
    return Verdict(True, f"{name}: {head}{basis}")


@dataclass(frozen=True)
class EverySteps:
    """Save when ``steps`` steps have passed since the tier's last save (or the run's start)."""

    steps: Count

    def __post_init__(self) -> None:
        validate(self)

    def describe(self) -> str:
        return f"every {self.steps} steps"

    def should_save(self, step: int, now: float, *, last: TierState, context: SaveContext) -> Verdict:
        base, what = (last.step, "last save") if last.step is not None else (context.started_step, "start")
        done = step - base
        if done >= self.steps:
            return Verdict(True, f"{self.describe()}: {done} steps since {what}")
        return Verdict(False, f"{self.describe()}: {self.steps - done} to go", steps_left=self.steps - done)


@dataclass(frozen=True)
class EveryInterval:
    """Save when ``seconds`` have passed since the tier's last save (or the run's start)."""

    seconds: Cadence

    def __post_init__(self) -> None:
        validate(self)

    def describe(self) -> str:
        return f"every {format_duration(self.seconds)}"

    def should_save(self, step: int, now: float, *, last: TierState, context: SaveContext) -> Verdict:
        return _after(self.describe(), self.seconds, now, last, context)


@functools.lru_cache(maxsize=1024)
def _next_fire(expr: str, timezone: str, after: float) -> float:
    start = datetime.datetime.fromtimestamp(after, zoneinfo.ZoneInfo(timezone))
    return float(croniter(expr, start, max_years_between_matches=HORIZON_YEARS).get_next(float))


def cron_problem(expr: object, timezone: str = "UTC") -> str | None:
    """What is wrong with ``expr`` as a save cadence (``None``: nothing): not cron, a year field, or a time that
    never comes (``0 0 31 2 *``: February has no 31st). Decided with the very croniter search
    :class:`Cron` saves by, over :data:`HORIZON_YEARS` from any date: the calendar repeats after that."""
    if not isinstance(expr, str) or not isinstance(timezone, str):
        return "a cron expression such as '0 * * * *' (minute hour day month weekday)"
    return _cron_problem(expr, timezone)


@functools.lru_cache(maxsize=256)
def _cron_problem(expr: str, timezone: str) -> str | None:
    if not croniter.is_valid(expr):
        return "a cron expression such as '0 * * * *' (minute hour day month weekday)"
    if len(expr.split()) > 6:
        return "a cron expression without a year field (minute hour day month weekday): one that ends stops saving"
    try:
        zone = zoneinfo.ZoneInfo(timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        return None  # the time zone's own error
    try:
        croniter(expr, datetime.datetime(2000, 1, 1, tzinfo=zone), max_years_between_matches=HORIZON_YEARS).get_next()
    except CroniterBadDateError:
        return (
            f"a cron expression that matches a time; this one matches none in {HORIZON_YEARS} years ({timezone}), so "
            "it would never save (a day that no month it lists has, such as February 30 or 31, or April 31?)"
        )
    return None


@dataclass(frozen=True)
class Cron:
    """Save when a time matching the cron expression (``minute hour day month weekday``) has come since the
    tier's last save (or the run's start). ``timezone`` is an IANA name; the default is UTC. An expression that
    never matches a time is refused (:func:`cron_problem`)."""

    expr: str
    timezone: str = "UTC"

    def __post_init__(self) -> None:
        try:
            zoneinfo.ZoneInfo(self.timezone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise invalid("timezone", "an IANA time zone such as 'UTC' or 'Europe/Paris'", self.timezone) from None
        if (problem := cron_problem(self.expr, self.timezone)) is not None:
            raise invalid("expr", problem, self.expr)

    def describe(self) -> str:
        tz = "" if self.timezone == "UTC" else f" {self.timezone}"
        return f"cron '{self.expr}'{tz}"

    def should_save(self, step: int, now: float, *, last: TierState, context: SaveContext) -> Verdict:
        since, what = _since(last, context)
        if since is None:
            return Verdict(True, f"{self.describe()}: no save yet and no start time")
        fire = _next_fire(self.expr, self.timezone, since)
        stamp = datetime.datetime.fromtimestamp(fire, zoneinfo.ZoneInfo(self.timezone)).isoformat()
        if fire <= now + _EPSILON:
            return Verdict(True, f"{self.describe()}: {stamp} came since {what}")
        return Verdict(False, f"{self.describe()}: next at {stamp}", seconds_left=fire - now)


@dataclass(frozen=True)
class Continuous:
    """Save again as soon as the previous save is done (the schedule already refuses while one is in flight),
    but not more often than ``min_interval``. Meant for the durable tier: the next upload starts when the
    previous one is committed. On the memory tier it would capture at every decision."""

    min_interval: Annotated[Duration, _HORIZON] = 0.0

    def __post_init__(self) -> None:
        validate(self)

    def describe(self) -> str:
        floor = f" (at most every {format_duration(self.min_interval)})" if self.min_interval else ""
        return f"continuous{floor}"

    def should_save(self, step: int, now: float, *, last: TierState, context: SaveContext) -> Verdict:
        since, _ = _since(last, context)
        if since is None or now - since >= self.min_interval - _EPSILON:
            return Verdict(True, f"{self.describe()}: previous save done")
        left = self.min_interval - (now - since)
        return Verdict(False, f"{self.describe()}: {format_duration(left)} to go", seconds_left=left)


@dataclass(frozen=True)
class OnPreemption:
    """Save once after a preemption signal: until the tier has a save taken at or after ``preempted_at``."""

    def describe(self) -> str:
        return "on preemption"

    def should_save(self, step: int, now: float, *, last: TierState, context: SaveContext) -> Verdict:
        at = context.preempted_at
        if at is None:
            return Verdict(False, "no preemption signal")
        if last.at is not None and last.at >= at:
            return Verdict(False, "preemption save already taken")
        return Verdict(True, f"preemption signal {format_duration(max(0.0, now - at))} ago")


def young_daly_interval(stall: float, mtbf: float) -> float:
    """Young's optimal checkpoint interval ``sqrt(2 * stall * mtbf)`` (Daly's first-order form).

    ``stall``: seconds training is blocked per save; ``mtbf``: mean time between failures of the whole job.
    """
    if stall < 0 or mtbf <= 0:
        raise ValueError(f"need stall >= 0 and mtbf > 0, got stall={stall!r} mtbf={mtbf!r}")
    return math.sqrt(2.0 * stall * mtbf)


@dataclass(frozen=True)
class YoungDaly:
    """Adaptive interval ``tau = sqrt(2 * stall * MTBF)``, from what the job measured, kept within
    ``[min_interval, max_interval]``. The stall is the mean of the last ``stall_window`` measured stalls (else
    ``stall_prior``); the MTBF is ``(prior_weight * mtbf_prior + T) / (prior_weight + n)`` for ``n`` failures in ``T``
    seconds observed: a Gamma prior's posterior mean, the prior at first, the observed mean as failures come."""

    mtbf_prior: PositiveDuration
    prior_weight: Annotated[float, _POSITIVE] = 1.0
    stall_prior: PositiveDuration = 1.0
    stall_window: Count = 16
    min_interval: Annotated[Duration, _HORIZON] = 0.0
    max_interval: PositiveDuration | None = None

    def __post_init__(self) -> None:
        validate(self)
        if self.max_interval is not None and self.max_interval < self.min_interval:
            raise invalid("max_interval", f">= min_interval ({format_duration(self.min_interval)})", self.max_interval)
        if (first := self._interval(self.stall_prior, self.mtbf_prior)) > HORIZON_SECONDS:
            raise invalid(
                "mtbf_prior",
                f"a prior whose interval fires within {HORIZON_YEARS} years (sqrt(2 * stall_prior * mtbf_prior) is "
                f"{format_duration(first)}; or set max_interval)",
                self.mtbf_prior,
            )

    def describe(self) -> str:
        return f"young/daly (MTBF prior {format_duration(self.mtbf_prior)})"

    def stall(self, context: SaveContext) -> float:
        """The stall per save the interval is based on."""
        recent = context.recent_stalls[-self.stall_window :]
        return sum(recent) / len(recent) if recent else self.stall_prior

    def mtbf(self, now: float, context: SaveContext) -> float:
        """The estimated mean time between failures of the job."""
        since = context.observed_since if context.observed_since is not None else context.started_at
        if since is None:
            return self.mtbf_prior
        failures = bisect.bisect_right(context.failures, now) - bisect.bisect_left(context.failures, since)
        observed = max(0.0, now - since)
        return (self.prior_weight * self.mtbf_prior + observed) / (self.prior_weight + failures)

    def interval(self, now: float, context: SaveContext) -> float:
        """The interval the policy saves at, given what ``context`` says at ``now``."""
        return self._interval(self.stall(context), self.mtbf(now, context))

    def _interval(self, stall: float, mtbf: float) -> float:
        tau = young_daly_interval(stall, mtbf)
        if self.max_interval is not None:
            tau = min(tau, self.max_interval)
        return max(tau, self.min_interval)

    def should_save(self, step: int, now: float, *, last: TierState, context: SaveContext) -> Verdict:
        stall, mtbf = self.stall(context), self.mtbf(now, context)
        tau = self._interval(stall, mtbf)
        n = len(context.failures)
        basis = (
            f", interval {format_duration(tau)} from stall {format_duration(stall)} and MTBF {format_duration(mtbf)}"
            f" ({n} failure{'s' if n != 1 else ''} seen, prior {format_duration(self.mtbf_prior)})"
        )
        return _after("young/daly", tau, now, last, context, basis)


@dataclass(frozen=True)
class ChainLimit:
    """Ask for a new base when the delta chain has ``max_chain`` links, or when the deltas add up to
    ``max_delta_percent`` % of the base's bytes (restores read base + every delta: keep that bounded)."""

    max_chain: Count | None = None
    max_delta_percent: Annotated[float, _POSITIVE] | None = None

    def __post_init__(self) -> None:
        validate(self)
        if self.max_chain is None and self.max_delta_percent is None:
            raise invalid("max_chain", "max_chain or max_delta_percent to be set", None)

    def describe(self) -> str:
        parts = (
            self.max_chain is not None and f"{self.max_chain} links",
            self.max_delta_percent is not None and f"deltas at {self.max_delta_percent:g}% of the base",
        )
        return "chain limit: " + " or ".join(p for p in parts if p)

    def should_save(self, step: int, now: float, *, last: TierState, context: SaveContext) -> Verdict:
        n = context.chain_length
        if self.max_chain is not None and n >= self.max_chain:
            return Verdict(True, f"delta chain has {n} links (limit {self.max_chain})")
        percent = 100.0 * context.delta_bytes / context.base_bytes if context.base_bytes > 0 else 0.0
        if self.max_delta_percent is not None and context.base_bytes > 0 and percent >= self.max_delta_percent:
            return Verdict(True, f"deltas are {percent:.0f}% of the base's bytes (limit {self.max_delta_percent:g}%)")
        limits = [f"{n}/{self.max_chain} links" if self.max_chain is not None else f"{n} links"]
        if self.max_delta_percent is not None:
            limits.append(f"deltas {percent:.0f}%/{self.max_delta_percent:g}% of the base")
        return Verdict(False, "chain limit: " + ", ".join(limits))


def base_rule(policy: SavePolicy) -> BaseRule:
    """``policy`` (a :class:`ChainLimit`, or a policy file's ``base:`` section) as the new-base rule of a
    :class:`~psguard.store.durable.DurableWriter`: the same decision whichever process writes the log."""

    def due(chain: ChainState, step: int) -> bool:
        base = TierState(chain.base_step)
        context = SaveContext(
            base=base, chain_length=chain.chain_length, delta_bytes=chain.delta_bytes, base_bytes=chain.base_bytes
        )
        return bool(policy.should_save(step, time.time(), last=base, context=context))

    return due


def _min(values: Iterable[float | None]) -> Any:
    present = [v for v in values if v is not None]
    return min(present) if present else None


@dataclass(frozen=True)
class AnyOf:
    """Save when any of ``policies`` says so (all are asked, so the reason names every one that fired)."""

    policies: tuple[SavePolicy, ...]

    def __post_init__(self) -> None:
        if not self.policies:
            raise invalid("policies", "at least one policy", self.policies)

    def describe(self) -> str:
        return " or ".join(p.describe() for p in self.policies)

    def should_save(self, step: int, now: float, *, last: TierState, context: SaveContext) -> Verdict:
        verdicts = [p.should_save(step, now, last=last, context=context) for p in self.policies]
        fired = [v for v in verdicts if v.save]
        if fired:
            return Verdict(True, ", ".join(v.reason for v in fired))
        return Verdict(
            False,
            ", ".join(v.reason for v in verdicts),
            seconds_left=_min(v.seconds_left for v in verdicts),
            steps_left=_min(v.steps_left for v in verdicts),
        )


@dataclass(frozen=True)
class Decision:
    """What :meth:`Schedule.decide` answered: the ``tiers`` to write now (truthy when any; ``DURABLE`` always
    with ``MEMORY``), why, whether it is an ``urgent`` preemption save, and when nothing is due the soonest any tier
    may become due by time or steps alone (callers may skip deciding until then)."""

    tiers: frozenset[Tier]
    reason: str
    step: int
    at: float
    urgent: bool = False
    seconds_left: float | None = None
    steps_left: int | None = None

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, for structured logs and the agent's status endpoint."""
        return fields_json(self, tiers=[t.value for t in _TIER_ORDER if t in self.tiers])


def _names(tiers: Iterable[Tier]) -> str:
    chosen = set(tiers)
    return "+".join(t.value for t in _TIER_ORDER if t in chosen)


@dataclass(frozen=True)
class Schedule:
    """One save policy per tier (``None``: never, except on preemption) and the tiers to save on preemption.

    :meth:`decide` is pure: same arguments, same decision.
    """

    memory: SavePolicy | None = None
    durable: SavePolicy | None = None
    base: SavePolicy | None = None
    on_preemption: frozenset[Tier] = frozenset({Tier.MEMORY})
    #: How far the durable log may trail this schedule's durable saves (:mod:`psguard.policy.lag`).
    durable_lag: LagBound = dataclasses.field(default_factory=LagBound)

    def policy(self, tier: Tier) -> SavePolicy | None:
        """The policy of ``tier``."""
        policy: SavePolicy | None = getattr(self, tier.value)
        return policy

    def describe(self) -> dict[str, str]:
        """Tier -> what its policy does, for ``psguard policy check`` and status pages."""
        out = {t.value: (p.describe() if (p := self.policy(t)) else "never") for t in _TIER_ORDER}
        out["preemption"] = _names(self.on_preemption) or "ignored"
        out["durable_lag"] = self.durable_lag.describe()
        return out

    def decide(self, step: int, now: float, context: SaveContext) -> Decision:
        """Which tiers to save at ``step``/``now`` given ``context``, and why. See :class:`Decision`."""
        if self.on_preemption and context.preempted_at is not None:
            asked = (OnPreemption().should_save(step, now, last=context.last(t), context=context) for t in _TIER_ORDER)
            pending = [v for t, v in zip(_TIER_ORDER, asked, strict=True) if t in self.on_preemption and v]
            if pending:
                urgent, verdict = frozenset(self.on_preemption) | {Tier.MEMORY}, pending[0]
                busy = f" (overriding the {_names(context.in_flight)} save in flight)" if context.in_flight else ""
                return Decision(urgent, f"save {_names(urgent)}: {verdict.reason}{busy}", step, now, urgent=True)
        if context.in_flight:
            return Decision(
                frozenset(), f"no save: {_names(context.in_flight)} save in flight; saves never overlap", step, now
            )
        verdicts = [
            (t, p.should_save(step, now, last=context.last(t), context=context))
            for t in _TIER_ORDER
            if (p := self.policy(t)) is not None
        ]
        tiers = {t for t, v in verdicts if v.save}
        fired = [f"{t.value}: {v.reason}" for t, v in verdicts if v.save]
        if Tier.DURABLE in tiers and Tier.MEMORY not in tiers:
            tiers.add(Tier.MEMORY)
            fired.insert(0, "memory: with the durable save")
        waiting = [(t, v) for t, v in verdicts if t not in tiers]
        not_due = "; ".join(f"{t.value}: {v.reason}" for t, v in waiting)
        if not tiers:
            if not verdicts:
                return Decision(frozenset(), "no save: no tier has a policy", step, now)
            return Decision(
                frozenset(),
                f"no save: {not_due}",
                step,
                now,
                seconds_left=_min(v.seconds_left for _, v in waiting),
                steps_left=_min(v.steps_left for _, v in waiting),
            )
        rest = f" | not due: {not_due}" if not_due else ""
        return Decision(frozenset(tiers), f"save {_names(tiers)}: {'; '.join(fired)}{rest}", step, now)


@dataclass(frozen=True)
class Retention:
    """Which committed checkpoints to keep: the last ``keep_last``, one every ``keep_every_hours``, and the
    ``keep_best`` best by ``metric`` (lowest when ``mode`` is ``min``); the newest always, and the store also keeps
    what a kept one needs. A retention that keeps nothing is rejected."""

    keep_last: Annotated[int, _NON_NEGATIVE] | None = 3
    keep_every_hours: Annotated[float, _POSITIVE] | None = None
    keep_best: Annotated[int, _NON_NEGATIVE] | None = None
    metric: str | None = None
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        validate(self)
        if self.mode not in ("min", "max"):
            raise invalid("mode", "'min' or 'max'", self.mode)
        if self.keep_best and not self.metric:
            raise invalid("metric", "the name of a reported metric (keep_best is set)", self.metric)
        if self.metric and not self.keep_best:
            raise invalid("keep_best", f"a count >= 1 (metric {self.metric!r} is set)", self.keep_best)
        if not self.keep_last and self.keep_every_hours is None and not self.keep_best:
            raise invalid(
                "keep_last",
                "a retention that keeps something: keep_last >= 1, keep_every_hours, or keep_best with a metric",
                self.keep_last,
            )

    def describe(self) -> str:
        parts = (
            self.keep_last and f"the last {self.keep_last}",
            self.keep_every_hours is not None and f"one every {self.keep_every_hours:g}h",
            self.keep_best and f"the best {self.keep_best} by {self.mode} {self.metric}",
        )
        return "keep " + ", ".join(p for p in parts if p)

    def select(self, candidates: Sequence[Candidate]) -> set[str]:
        """Ids of ``candidates`` the rules keep (:func:`psguard.store.retention.select_kept`). Deleting the rest is the
        store's job (``Store.gc(**retention.as_kwargs())``), which also keeps every parent a kept delta needs."""
        return select_kept(candidates, **self.as_kwargs())

    def as_kwargs(self) -> dict[str, Any]:
        """The rules as keyword arguments of ``select_kept`` and ``Store.gc``."""
        return fields_json(self)
