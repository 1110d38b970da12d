"""The decision engine (psguard.policy.engine): each policy on a scripted timeline, composition, the schedule's rules,
the adaptive Young/Daly interval, and retention. Time is always passed in: no sleeps, no real clock."""

from __future__ import annotations

import calendar
import dataclasses
import json
import math
import random
import time
from collections.abc import Callable, Sequence

import pytest

from psguard.errors import ConfigError
from psguard.handoff.contract import Tier
from psguard.policy.engine import (
    HORIZON_SECONDS,
    AnyOf,
    ChainLimit,
    Continuous,
    Cron,
    Decision,
    EveryInterval,
    EverySteps,
    OnPreemption,
    Retention,
    SaveContext,
    SavePolicy,
    Schedule,
    TierState,
    Verdict,
    YoungDaly,
    cron_problem,
    young_daly_interval,
)
from psguard.store.retention import Candidate

M, D, B = Tier.MEMORY, Tier.DURABLE, Tier.BASE
T0 = float(calendar.timegm((2026, 1, 1, 0, 0, 0)))  # a round UTC hour, for cron


def drive(schedule: Schedule, timeline: Sequence[tuple[int, float]], context: SaveContext) -> list[Decision]:
    """Ask at each (step, time); record every save in the context, as the CheckpointManager will."""
    out = []
    for step, now in timeline:
        decision = schedule.decide(step, now, context)
        if decision:
            context = context.with_save(decision.tiers, step=step, at=now, stall=0.1)
        out.append(decision)
    return out


def saved_at(decisions: Sequence[Decision], tier: Tier = M) -> list[int]:
    return [d.step for d in decisions if tier in d.tiers]


# ------------------------------------------------------------------------------------- single policies
def test_every_steps_counts_from_the_last_save_of_the_tier() -> None:
    policy = EverySteps(100)
    ctx = SaveContext(started_step=0)
    assert not policy.should_save(99, 0.0, last=TierState(), context=ctx)
    assert policy.should_save(99, 0.0, last=TierState(), context=ctx).steps_left == 1
    assert policy.should_save(100, 0.0, last=TierState(), context=ctx)
    assert not policy.should_save(150, 0.0, last=TierState(step=60), context=ctx)
    assert policy.should_save(160, 0.0, last=TierState(step=60), context=ctx)
    # Decisions come every 30 steps (a batch of steps): saves land on the first batch past each 100 steps.
    decisions = drive(Schedule(memory=policy), [(s, float(s)) for s in range(0, 481, 30)], ctx)
    assert saved_at(decisions) == [120, 240, 360, 480]


def test_every_interval_on_a_scripted_clock() -> None:
    schedule = Schedule(memory=EveryInterval(30.0))
    ctx = SaveContext(started_at=T0)
    times = [T0 + t for t in (0, 10, 29.9, 30, 45, 59.9, 60.5, 61, 95)]
    decisions = drive(schedule, [(i, t) for i, t in enumerate(times)], ctx)
    assert [d.at - T0 for d in decisions if d] == [30, 60.5, 95]
    first = decisions[1]
    assert not first and first.seconds_left == pytest.approx(20.0)
    assert "every 30s" in first.reason and "20s to go" in first.reason
    assert "since start" in decisions[3].reason and "since last save" in decisions[6].reason


def test_time_policy_without_any_baseline_saves_at_once() -> None:
    verdict = EveryInterval(60.0).should_save(0, T0, last=TierState(), context=SaveContext())
    assert verdict and "no save yet" in verdict.reason


def test_cron_saves_once_per_matching_time() -> None:
    schedule = Schedule(durable=Cron("0 * * * *"))
    ctx = SaveContext(started_at=T0 + 60)  # started at 00:01
    times = [T0 + m * 60 for m in (2, 30, 59, 60, 61, 119, 125, 240)]
    decisions = drive(schedule, [(i, t) for i, t in enumerate(times)], ctx)
    # 01:00 fires once; 02:00 is seen at 02:05; 03:00 was skipped entirely but 04:00 fires at 04:00.
    assert [round((d.at - T0) / 60) for d in decisions if d] == [60, 125, 240]
    assert decisions[0].seconds_left == pytest.approx(58 * 60)
    assert "2026-01-01T01:00:00+00:00" in decisions[0].reason


def test_cron_time_zone() -> None:
    policy = Cron("0 9 * * *", timezone="Europe/Paris")  # 09:00 in Paris is 08:00 UTC in January
    verdict = policy.should_save(0, T0, last=TierState(at=T0), context=SaveContext())
    assert verdict.seconds_left == pytest.approx(8 * 3600)


@pytest.mark.parametrize("expr", ["61 * * * *", "every hour", "* * *", ""])
def test_bad_cron_is_rejected(expr: str) -> None:
    with pytest.raises(ConfigError, match="expr: expected a cron expression"):
        Cron(expr)
    with pytest.raises(ConfigError, match="timezone"):
        Cron("0 * * * *", timezone="Mars/Olympus")


@pytest.mark.parametrize(
    "expr",
    [
        "0 0 31 2 *",  # February 31st
        "0 0 30 2 *",
        "0 0 31 4,6,9,11 *",  # April, June, September, November have 30 days
        "15 3 31 2 ?",
        "0 0 31 2 * 0",  # with a seconds field
        "0 0 1 1 * 0 2020",  # a year field: a schedule that ends (here: ended)
    ],
)
def test_a_cron_that_can_never_fire_is_refused(expr: str) -> None:
    with pytest.raises(ConfigError, match="expr: expected a cron expression"):
        Cron(expr)
    with pytest.raises(ConfigError, match="expr: expected a cron expression"):
        Cron(expr, timezone="Europe/Paris")
    assert cron_problem(expr) is not None


@pytest.mark.parametrize(
    ("expr", "first"),
    [
        ("0 0 29 2 *", (2028, 2, 29)),  # only in leap years, but it fires
        ("0 0 L 2 *", (2026, 2, 28)),  # the last day of February
        ("0 0 30,31 2,3 *", (2026, 3, 30)),  # March has them
        ("0 0 31 2 1", (2026, 2, 2)),  # day of month OR weekday, as cron means it: Mondays in February
        ("0 0 * 2 5#5", (2036, 2, 29)),  # a fifth Friday of February: once in 28 years
    ],
)
def test_a_rare_cron_is_accepted_and_fires(expr: str, first: tuple[int, int, int]) -> None:
    assert cron_problem(expr) is None
    verdict = Cron(expr).should_save(0, T0, last=TierState(at=T0), context=SaveContext())
    assert verdict.seconds_left is not None
    assert time.gmtime(T0 + verdict.seconds_left)[:3] == first


@pytest.mark.parametrize(
    ("make", "key"),
    [
        (lambda: EveryInterval(HORIZON_SECONDS * 2), "seconds"),
        (lambda: Continuous(min_interval=HORIZON_SECONDS * 2), "min_interval"),
        (lambda: YoungDaly(mtbf_prior=1.0, min_interval=HORIZON_SECONDS * 2), "min_interval"),
        (lambda: YoungDaly(mtbf_prior=9e18, stall_prior=9e18), "mtbf_prior"),
        (lambda: EveryInterval(math.inf), "seconds"),
        (lambda: EveryInterval(math.nan), "seconds"),
        (lambda: EveryInterval(-1.0), "seconds"),
        (lambda: EverySteps(0), "steps"),
        (lambda: EverySteps(-5), "steps"),
    ],
)
def test_an_interval_that_never_comes_is_refused(make: Callable[[], object], key: str) -> None:
    with pytest.raises(ConfigError, match=f"^{key}: expected"):
        make()


def test_cadences_up_to_the_horizon_are_kept() -> None:
    assert EveryInterval(HORIZON_SECONDS).seconds == HORIZON_SECONDS
    assert YoungDaly(mtbf_prior=9e18, stall_prior=9e18, max_interval=3600.0).interval(T0, SaveContext()) == 3600.0


def test_continuous_waits_for_the_previous_save_and_the_floor() -> None:
    schedule = Schedule(durable=Continuous(min_interval=5.0))
    ctx = SaveContext(started_at=T0)
    assert not schedule.decide(1, T0 + 4, ctx)  # the floor counts from the start too
    first = schedule.decide(1, T0 + 5, ctx)
    assert first.tiers == {M, D} and "continuous (at most every 5s): previous save done" in first.reason
    ctx = dataclasses.replace(ctx.with_save(first.tiers, step=1, at=T0), in_flight=frozenset({D}))
    busy = schedule.decide(2, T0 + 20, ctx)
    assert not busy and "durable save in flight" in busy.reason
    ctx = dataclasses.replace(ctx, in_flight=frozenset())  # committed
    assert schedule.decide(3, T0 + 21, ctx).tiers == {M, D}
    ctx = ctx.with_save({M, D}, step=3, at=T0 + 21)
    early = schedule.decide(4, T0 + 23, ctx)
    assert not early and early.seconds_left == pytest.approx(3.0)


def test_on_preemption_saves_once_after_the_signal() -> None:
    policy = OnPreemption()
    assert not policy.should_save(1, T0, last=TierState(), context=SaveContext())
    ctx = SaveContext(preempted_at=T0)
    assert policy.should_save(1, T0 + 1, last=TierState(at=T0 - 5), context=ctx)
    taken = policy.should_save(2, T0 + 2, last=TierState(at=T0 + 1), context=ctx)
    assert not taken and "already taken" in taken.reason


def test_chain_limit_by_links_and_by_bytes() -> None:
    policy = ChainLimit(max_chain=3, max_delta_percent=50.0)
    last = TierState()
    ctx = SaveContext(base_bytes=1000)
    for _ in range(2):
        ctx = ctx.with_save({M, D}, step=1, at=T0, delta_bytes=100)
    assert not policy.should_save(1, T0, last=last, context=ctx)
    ctx3 = ctx.with_save({M, D}, step=1, at=T0, delta_bytes=100)
    assert "3 links" in policy.should_save(1, T0, last=last, context=ctx3).reason
    big = ctx.with_save({M, D}, step=1, at=T0, delta_bytes=400)
    v = ChainLimit(max_delta_percent=50.0).should_save(1, T0, last=last, context=big)
    assert v and "60% of the base" in v.reason
    rebased = big.with_save({B}, step=2, at=T0, base_bytes=2000)
    assert rebased.chain_length == 0 and rebased.delta_bytes == 0 and rebased.base_bytes == 2000
    assert not policy.should_save(2, T0, last=last, context=rebased)
    with pytest.raises(ConfigError, match="max_chain"):
        ChainLimit()


# ------------------------------------------------------------------------------------------- composition
def test_any_of_saves_when_any_policy_fires_and_names_them() -> None:
    policy = AnyOf((EverySteps(1000), EveryInterval(60.0)))
    ctx = SaveContext(started_step=0, started_at=T0)
    by_time = policy.should_save(10, T0 + 61, last=TierState(), context=ctx)
    assert by_time and "every 1m" in by_time.reason and "steps" not in by_time.reason
    both = policy.should_save(1000, T0 + 61, last=TierState(), context=ctx)
    assert "every 1000 steps" in both.reason and "every 1m" in both.reason
    neither = policy.should_save(400, T0 + 20, last=TierState(), context=ctx)
    assert not neither
    assert neither.seconds_left == pytest.approx(40.0)
    assert neither.steps_left == 600
    decisions = drive(Schedule(memory=policy), [(s, T0 + s / 10) for s in range(0, 3001, 100)], ctx)
    assert saved_at(decisions) == [600, 1200, 1800, 2400, 3000]  # 60 s = 600 steps reaches first
    assert policy.describe() == "every 1000 steps or every 1m"
    with pytest.raises(ConfigError):
        AnyOf(())


def test_a_custom_policy_fits_the_protocol_and_composes() -> None:
    @dataclasses.dataclass(frozen=True)
    class AtSteps:
        steps: frozenset[int]

        def describe(self) -> str:
            return "at chosen steps"

        def should_save(self, step: int, now: float, *, last: TierState, context: SaveContext) -> Verdict:
            return Verdict(step in self.steps, f"step {step} {'is' if step in self.steps else 'is not'} chosen")

    custom = AtSteps(frozenset({7}))
    assert isinstance(custom, SavePolicy)
    schedule = Schedule(memory=AnyOf((custom, EverySteps(100))))
    decisions = drive(schedule, [(s, T0) for s in range(0, 12)], SaveContext())
    assert saved_at(decisions) == [7]
    assert "step 7 is chosen" in decisions[7].reason


# ------------------------------------------------------------------------------------------ the schedule
def default_schedule() -> Schedule:
    return Schedule(
        memory=EveryInterval(30.0),
        durable=EveryInterval(600.0),
        base=AnyOf((EveryInterval(3600.0), ChainLimit(max_chain=10))),
    )


def test_tier_cadences_over_a_scripted_timeline() -> None:
    ctx = SaveContext(started_at=T0, started_step=0)
    decisions = drive(default_schedule(), [(t, T0 + t) for t in range(0, 3601, 10)], ctx)
    mem, dur, base = (saved_at(decisions, t) for t in (M, D, B))
    assert mem == list(range(30, 3601, 30))  # durable saves also write memory: the cadence stays 30 s
    assert dur == list(range(600, 3601, 600))
    assert base == [3600]  # hourly (the chain had 6 links, under its limit of 10)
    chain_base = drive(
        dataclasses.replace(default_schedule(), base=ChainLimit(max_chain=4)),
        [(t, T0 + t) for t in range(0, 3601, 10)],
        ctx,
    )
    assert saved_at(chain_base, B) == [2410]  # chain reached 4 links at the 2400 s save, asked at the next call


def test_durable_always_comes_with_memory_and_says_so() -> None:
    schedule = Schedule(memory=EveryInterval(3600.0), durable=EveryInterval(60.0))
    d = schedule.decide(1, T0 + 61, SaveContext(started_at=T0))
    assert d.tiers == {M, D}
    assert d.reason.startswith("save memory+durable: memory: with the durable save; durable: every 1m")
    assert "not due: memory: every 1h" not in d.reason  # memory is being saved: not listed as waiting


def test_saves_never_overlap() -> None:
    schedule = default_schedule()
    ctx = SaveContext(started_at=T0, in_flight=frozenset({D}))
    d = schedule.decide(5, T0 + 10_000, ctx)  # everything is overdue, but a durable save is in flight
    assert not d and d.tiers == frozenset()
    assert d.reason == "no save: durable save in flight; saves never overlap"


def test_preemption_overrides_in_flight_and_is_urgent() -> None:
    schedule = dataclasses.replace(default_schedule(), on_preemption=frozenset({M, D}))
    ctx = SaveContext(started_at=T0, memory=TierState(1, T0 + 1), in_flight=frozenset({D}), preempted_at=T0 + 5)
    d = schedule.decide(9, T0 + 6, ctx)
    assert d.urgent and d.tiers == {M, D}
    assert "preemption signal 1s ago" in d.reason and "overriding the durable save in flight" in d.reason
    after = ctx.with_save(d.tiers, step=9, at=T0 + 6)
    again = schedule.decide(10, T0 + 7, after)
    assert not again.urgent and not again  # taken once; the in-flight rule applies again


def test_preemption_ignored_when_not_configured() -> None:
    schedule = dataclasses.replace(default_schedule(), on_preemption=frozenset())
    d = schedule.decide(9, T0 + 6, SaveContext(started_at=T0, preempted_at=T0 + 5))
    assert not d.urgent and not d
    assert schedule.describe()["preemption"] == "ignored"


def test_base_can_be_asked_alone_and_no_tier_means_no_save() -> None:
    schedule = Schedule(durable=EveryInterval(600.0), base=ChainLimit(max_chain=2))
    ctx = SaveContext(started_at=T0, durable=TierState(1, T0), chain_length=2)
    d = schedule.decide(2, T0 + 1, ctx)
    assert d.tiers == {B} and "delta chain has 2 links" in d.reason
    nothing = Schedule().decide(1, T0, SaveContext())
    assert not nothing and nothing.reason == "no save: no tier has a policy"


def test_decision_is_json_ready_and_hints_the_next_check() -> None:
    d = default_schedule().decide(3, T0 + 10, SaveContext(started_at=T0))
    data = json.loads(json.dumps(d.to_dict()))
    assert data["tiers"] == [] and data["step"] == 3 and data["seconds_left"] == pytest.approx(20.0)
    assert data["reason"].startswith("no save: memory: every 30s: 20s to go; durable: every 10m")
    saving = default_schedule().decide(4, T0 + 600, SaveContext(started_at=T0)).to_dict()
    assert saving["tiers"] == ["memory", "durable"]


def test_with_save_keeps_a_bounded_stall_history() -> None:
    ctx = SaveContext()
    for i in range(40):
        ctx = ctx.with_save({M}, step=i, at=float(i), stall=float(i))
    assert len(ctx.recent_stalls) == 32 and ctx.recent_stalls[-1] == 39.0
    assert ctx.memory == TierState(39, 39.0) and ctx.durable == TierState()
    assert ctx.with_failure(5.0).failures == (5.0,)


# ------------------------------------------------------------------------------------------- young/daly
def test_young_daly_formula_and_prior() -> None:
    assert young_daly_interval(0.5, 6 * 3600) == pytest.approx(math.sqrt(2 * 0.5 * 21600))
    with pytest.raises(ValueError):
        young_daly_interval(0.5, 0)
    policy = YoungDaly(mtbf_prior=3600.0, stall_prior=2.0)
    # Nothing measured, nothing observed: the priors.
    assert policy.interval(T0, SaveContext()) == pytest.approx(math.sqrt(2 * 2.0 * 3600))
    # Measured stalls replace the stall prior (mean of the last stall_window).
    ctx = SaveContext(recent_stalls=(9.0,) + (0.5,) * 16)
    assert policy.stall(ctx) == pytest.approx(0.5)
    # Failures observed: (w * prior + T) / (w + n).
    ctx = SaveContext(observed_since=T0, failures=(T0 + 100, T0 + 200, T0 + 300))
    assert policy.mtbf(T0 + 7200, ctx) == pytest.approx((3600 + 7200) / 4)
    clamped = dataclasses.replace(policy, min_interval=100.0, max_interval=110.0)
    assert clamped.interval(T0, SaveContext()) == pytest.approx(110.0)
    with pytest.raises(ConfigError, match="max_interval"):
        YoungDaly(mtbf_prior=3600.0, min_interval=60.0, max_interval=30.0)
    with pytest.raises(ConfigError, match="mtbf_prior"):
        YoungDaly(mtbf_prior=-1.0)


def test_young_daly_verdict_explains_its_interval() -> None:
    policy = YoungDaly(mtbf_prior=3600.0, stall_prior=0.5)
    ctx = SaveContext(started_at=T0)
    v = policy.should_save(1, T0 + 10, last=TierState(), context=ctx)
    assert not v and v.seconds_left is not None
    assert "stall 500ms" in v.reason and "0 failures seen, prior 1h" in v.reason


def test_young_daly_converges_on_a_simulated_failure_process() -> None:
    """Failures with exponential inter-arrival times (mean 1 h); noisy measured stalls (mean 0.5 s). The
    prior is badly wrong (MTBF 100 s, stall 2 s); the interval must end within 10% of sqrt(2*stall*MTBF)."""
    rng = random.Random(20261129)
    true_mtbf, true_stall = 3600.0, 0.5
    target = math.sqrt(2 * true_stall * true_mtbf)
    policy = YoungDaly(mtbf_prior=100.0, stall_prior=2.0)
    schedule = Schedule(memory=policy)
    ctx = SaveContext(started_at=0.0, observed_since=0.0)
    now, step, next_failure, failures = 0.0, 0, rng.expovariate(1 / true_mtbf), 0
    first = policy.interval(now, ctx)
    save_times: list[float] = []
    while failures < 300:
        if next_failure <= now:
            ctx = ctx.with_failure(next_failure)
            failures += 1
            next_failure += rng.expovariate(1 / true_mtbf)
            continue
        d = schedule.decide(step, now, ctx)
        if d:
            stall = max(0.0, rng.gauss(true_stall, 0.1))
            ctx = ctx.with_save(d.tiers, step=step, at=now, stall=stall)
            save_times.append(now)
            now += stall
        else:
            assert d.seconds_left is not None
            now = min(now + max(d.seconds_left, 1e-6), next_failure)
        step += 1
    assert abs(first - target) / target > 0.5  # it really had to move
    final = policy.interval(now, ctx)
    assert abs(final - target) / target < 0.10, (final, target)
    gaps = [b - a for a, b in zip(save_times[-50:], save_times[-49:], strict=False)]
    actual = sum(gaps) / len(gaps)  # the interval the schedule really saved at
    assert abs(actual - target) / target < 0.10, (actual, target)


# -------------------------------------------------------------------------------------------- retention
def candidates(n: int) -> list[Candidate]:
    return [Candidate(f"c{i}", i * 100, T0 + i * 3600, {"loss": float((i * 7) % 5)}) for i in range(n)]


def test_retention_selects_through_select_kept() -> None:
    assert Retention(keep_last=2).select(candidates(6)) == {"c4", "c5"}
    assert Retention(keep_last=None, keep_every_hours=3).select(candidates(6)) == {"c0", "c3", "c5"}
    best = Retention(keep_last=1, keep_best=3, metric="loss").select(candidates(6))
    assert best == {"c5", "c0", "c3"}  # losses: c0 0, c1 2, c2 4, c3 1, c4 3, c5 0
    high = Retention(keep_last=1, keep_best=1, metric="loss", mode="max").select(candidates(6))
    assert high == {"c5", "c2"}
    assert Retention(keep_last=2).as_kwargs()["keep_last"] == 2


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"keep_last": 0}, "keep_last: expected a retention that keeps something"),
        ({"keep_last": None}, "keep_last: expected a retention that keeps something"),
        ({"keep_last": -1}, "keep_last: expected (>= 0)"),
        ({"keep_every_hours": 0}, "keep_every_hours: expected (> 0)"),
        ({"keep_best": 2}, "metric: expected the name of a reported metric"),
        ({"metric": "loss"}, "keep_best: expected a count >= 1"),
        ({"keep_best": 1, "metric": "auc", "mode": "avg"}, "mode: expected 'min' or 'max'"),
    ],
)
def test_retention_rejects_impossible_rules(kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        Retention(**kwargs)  # type: ignore[arg-type]
    assert key in str(err.value)


def test_the_package_exports_what_the_engine_declares_public() -> None:
    """The engine's ``__all__`` is the one list of its public names: ``psguard.policy`` exports each (the same
    object) and nothing of the engine that it does not list."""
    import psguard.policy
    from psguard.policy import engine, lag

    exported = set(psguard.policy.__all__)
    assert exported == set(engine.__all__) | set(lag.__all__)
    for name in exported:
        assert getattr(psguard.policy, name) is getattr(engine if name in engine.__all__ else lag, name)
