"""The recovery plan over the whole input space that matters: every task state, tier, copy placement, memory tier
and durable log a recovery can meet, with the invariants that make a restore correct; and every rule of the
table in docs/design.md reached by an example, so the table and the function agree."""

from __future__ import annotations

import itertools
import re

import pytest

from psguard.handoff.contract import EXIT_RESTART
from psguard.handoff.plan import (
    RULES,
    Action,
    Copy,
    Durable,
    Facts,
    Failure,
    Memory,
    Options,
    Process,
    RecoveryPlan,
    Shards,
    Source,
    TaskReport,
    TaskState,
    TierState,
    failure_moment,
    plan,
    reported_moment,
    rules_table,
)
from tests.support.paths import ROOT

TOKEN, OTHER = "t-now", "t-before"
PS = ("ps:0", "ps:1", "ps:2")
NODES = {"ps:0": "a", "ps:1": "b", "ps:2": "c"}
FAILED_AT = 1000.0

# ------------------------------------------------------------------------------------------ the state space
TIERS = {"at": TierState(50, TOKEN), "other": TierState(30, OTHER), "empty": TierState()}
MEMORIES = {
    "absent": None,
    "ahead": Memory(50, TOKEN),
    "even": Memory(40, TOKEN),  # the log's step: the memory tier serves, with no storage read
    "behind": Memory(30, TOKEN),  # older than the log's 40
    "damaged": Memory(50, TOKEN, loads=False),
}
DURABLES = {"none": Durable.none(), "at-40": Durable.at(40, "ckpt-40"), "unknown": Durable()}
PLACEMENTS = ("none", "full", "parity", "unknown")
LOST_NODES: tuple[frozenset[str], ...] = (frozenset(), frozenset({"a"}), frozenset({"a", "b"}), frozenset({"c"}))


def copies(placement: str, task: str) -> tuple[Copy, ...] | None:
    """``full``: ps:i's copy on ps:i+1 (a ring); ``parity``: ps:0 and ps:1 in one group held by ps:2."""
    if placement == "none":
        return ()
    if placement == "unknown":
        return None
    if placement == "full":
        return (Copy(PS[(PS.index(task) + 1) % len(PS)], TOKEN),)
    return (Copy("ps:2", TOKEN, ("ps:0", "ps:1")),) if task != "ps:2" else ()


def cluster(tiers: tuple[str, ...], placement: str, lost: frozenset[str]) -> tuple[TaskReport, ...]:
    """Three PS; a PS on a lost node has a new agent with an empty tier, whatever it held."""
    return tuple(
        TaskReport(
            t,
            TaskState.NEW if NODES[t] in lost else TaskState.UP,
            node=NODES[t],
            tier=TierState() if NODES[t] in lost else TIERS[tier],
            copies=copies(placement, t),
        )
        for t, tier in zip(PS, tiers, strict=True)
    )


def bringable(reports: tuple[TaskReport, ...], placement: str, lost: frozenset[str]) -> bool:
    """The oracle, written apart from the plan: every PS can be given the memory tier's token."""
    own = {r.task: r.node not in lost and r.tier is not None and r.tier.token == TOKEN for r in reports}
    alive = {r.task: r.node not in lost and r.tier is not None and r.tier.token is not None for r in reports}

    def ok(t: str) -> bool:
        if own[t] or placement == "unknown":  # unknown copies: the holder is asked
            return True
        if placement == "full":
            return alive[PS[(PS.index(t) + 1) % len(PS)]]
        if placement == "parity" and t != "ps:2":
            other = "ps:1" if t == "ps:0" else "ps:0"
            return alive["ps:2"] and own[other]
        return False

    return all(ok(t) for t in PS)


SPACE = list(itertools.product(itertools.product(TIERS, repeat=3), PLACEMENTS, MEMORIES, DURABLES, LOST_NODES))


def test_the_space_is_whole() -> None:
    assert len(SPACE) == 27 * 4 * 5 * 3 * 4


def test_every_combination_keeps_the_invariants() -> None:
    """Every tier state of three PS x copy placement x memory tier x durable log x lost nodes."""
    for tiers, placement, memory_name, durable_name, lost in SPACE:
        reports = cluster(tiers, placement, lost)
        memory, durable = MEMORIES[memory_name], DURABLES[durable_name]
        p = plan(Facts(reports, memory, durable, Failure(FAILED_AT, nodes=lost)))
        case = (tiers, placement, memory_name, durable_name, sorted(lost))
        check_restore(p, memory, durable, bringable(reports, placement, lost), case)
        check_tasks(p, {r.task: r for r in reports}, lost, case)


def check_restore(p: RecoveryPlan, memory: Memory | None, durable: Durable, held: bool, case: object) -> None:
    restore = p.restore
    usable = memory is not None and memory.loads and held
    # Never initial values while an acknowledged commit or a memory state every PS can be given exists.
    if durable.step is not None or usable:
        assert restore.source is not Source.INITIAL, case
    # The restored step is the newest state every PS can be brought to (the memory tier on a tie: no read).
    if usable and memory is not None and (durable.step is None or memory.step >= durable.step):  # type: ignore[operator]
        assert (restore.source, restore.step, restore.token) == (Source.MEMORY, memory.step, TOKEN), case
    elif durable.step is not None:
        assert (restore.source, restore.step, restore.checkpoint) == (Source.DURABLE, 40, "ckpt-40"), case
    elif durable.known:
        assert restore.source is Source.INITIAL, case
    else:  # the log not asked yet: its newest commit that loads, once it answers
        assert (restore.source, restore.step) == (Source.DURABLE, None), case
    assert restore.force == (memory is not None and not memory.loads and restore.source is Source.DURABLE), case


def check_tasks(p: RecoveryPlan, reports: dict[str, TaskReport], lost: frozenset[str], case: object) -> None:
    """A task kept on its own tier holds the restored state; one that fetches names a living copy of it."""
    for task in p.tasks.values():
        tier = reports[task.task].tier
        if p.restore.source is Source.MEMORY:
            assert task.shards in (Shards.OWN, Shards.PEER), case
            assert (task.shards is Shards.OWN) == (task.action is not Action.FETCH_FROM_PEER), case
        elif p.restore.source is Source.DURABLE:
            assert task.shards is Shards.LOG and task.holder is None, case
        else:
            assert task.shards is Shards.NONE, case
        if task.shards is Shards.OWN:
            assert tier is not None and tier.token == p.restore.token and reports[task.task].node not in lost, case
        if task.shards is Shards.PEER and task.holder is not None:
            holder = reports[task.holder]
            assert holder.node not in lost and holder.tier is not None and holder.tier.token is not None, case


@pytest.mark.parametrize("placement", ["none", "full", "parity"])
def test_a_node_lost_with_its_copy_holder_falls_to_the_log(placement: str) -> None:
    """ps:0's copy (full) or its group's parity is on ps:1 or ps:2; their nodes lost together: the log serves."""
    holder_node = {"none": "b", "full": "b", "parity": "c"}[placement]
    lost = frozenset({"a", holder_node})
    reports = cluster(("at", "at", "at"), placement, lost)
    p = plan(Facts(reports, Memory(50, TOKEN), Durable.at(40, "ckpt-40"), Failure(FAILED_AT, nodes=lost)))
    assert p.restore.source is Source.DURABLE and p.restore.rule == "memory-not-held"
    assert p.tasks["ps:0"].action is Action.RESTORE_FROM_LOG


def test_a_lost_node_with_a_living_holder_fetches_from_it() -> None:
    reports = cluster(("at", "at", "at"), "full", frozenset({"a"}))
    p = plan(Facts(reports, Memory(50, TOKEN), Durable.at(40), Failure(FAILED_AT, nodes=frozenset({"a"}))))
    assert p.restore.source is Source.MEMORY and p.restore.step == 50
    assert p.tasks["ps:0"].action is Action.FETCH_FROM_PEER and p.tasks["ps:0"].holder == "ps:1"
    assert p.tasks["ps:1"].shards is Shards.OWN


# ------------------------------------------------------------------------------------------ which PS restarts
STATES = list(TaskState)
STARTS = {"before": FAILED_AT - 5.0, "after": FAILED_AT + 0.1, "none": None}


@pytest.mark.parametrize(
    ("role", "new_process", "restart_workers"),
    [(r, n, w) for r in ("ps", "worker", "evaluator") for n in (True, False) for w in (True, False)],
)
def test_every_task_state_gets_the_generations_rule(role: str, new_process: bool, restart_workers: bool) -> None:
    """Each role x task state x run start x failure moment x readiness x peers settings, against the rules."""
    for state, start, at, ready, keep, restart_ps in itertools.product(
        STATES, STARTS, (FAILED_AT, None), (True, False), (True, False), (True, False)
    ):
        report = TaskReport(f"{role}:0", state, STARTS[start], ready)
        failure = Failure(at, new_trainer_process=new_process)
        options = Options(restart_ps, restart_workers, keep)
        task = plan(Facts((report,), failure=failure, options=options)).tasks[report.task]
        restarted_role = role == "ps" or (role == "worker" and new_process and restart_workers)
        if not restart_ps:
            expected = Process.WAIT_FOR
        elif not restarted_role:
            expected = Process.KEEP
        elif state is TaskState.NEW or (at is not None and start == "after"):
            expected = Process.WAIT_FOR  # it holds nothing of the failed generation: never killed again
        elif role == "ps" and at is not None and keep and not new_process and ready and state is TaskState.UP:
            expected = Process.KEEP
        else:
            expected = Process.RESTART
        assert task.process is expected, (state, start, at, ready, keep, restart_ps)


def test_the_trainer_restarts_as_a_new_process_and_is_kept_when_it_rejoins() -> None:
    chief = TaskReport("chief:0")
    assert plan(Facts((chief,))).tasks["chief:0"].action is Action.RESTART
    rejoin = Facts((chief,), failure=Failure(new_trainer_process=False))
    assert plan(rejoin).tasks["chief:0"].action is Action.KEEP


def test_a_task_seen_failed_is_never_kept_as_a_survivor() -> None:
    ps = TaskReport("ps:0", run_started_at=FAILED_AT - 5, ready=True)
    options = Options(keep_survivors=True)
    survived = Failure(FAILED_AT, new_trainer_process=False)
    assert plan(Facts((ps,), failure=survived, options=options)).tasks["ps:0"].process is Process.KEEP
    failed = Failure(FAILED_AT, tasks=frozenset({"ps:0"}), new_trainer_process=False)
    assert plan(Facts((ps,), failure=failed, options=options)).tasks["ps:0"].process is Process.RESTART


# ------------------------------------------------------------------------------------------ the moments
def test_the_failure_moment_is_the_last_step_seen_else_when_the_failure_was_seen() -> None:
    assert failure_moment(100.0, 98.5) == 98.5
    assert failure_moment(100.0, None) == 100.0
    assert failure_moment(100.0, 101.0) == 100.0  # a clock that stepped: never later than seen


@pytest.mark.parametrize(
    ("reported", "exit_code", "kept"),
    [(105.0, EXIT_RESTART, True), (95.0, EXIT_RESTART, False), (105.0, 1, False), (None, EXIT_RESTART, False)],
)
def test_only_the_run_that_asked_for_a_restart_reports_the_moment(
    reported: float | None, exit_code: int, kept: bool
) -> None:
    assert reported_moment(reported, run_started_at=100.0, exit_code=exit_code) == (reported if kept else None)


# ------------------------------------------------------------------------------------------ the agents' refusal
@pytest.mark.parametrize(
    ("memory", "held", "checkpoint", "refused"),
    [(50, True, 40, True), (50, None, 40, True), (50, False, 40, False), (40, True, 40, False), (30, True, 40, False)],
)
def test_the_log_is_refused_only_over_a_newer_state_every_ps_may_still_give(
    memory: int, held: bool | None, checkpoint: int, refused: bool
) -> None:
    p = plan(Facts(memory=Memory(memory, TOKEN, held=held), durable=Durable.at(checkpoint)))
    assert p.loses(checkpoint) is refused


# ------------------------------------------------------------------------------------------ the table
def examples() -> dict[str, tuple[Facts, str]]:
    """A plan that each rule decides: its facts and the task (or ``restore``) it decides."""
    ps = TaskReport("ps:0", run_started_at=FAILED_AT - 5, ready=True, tier=TierState(50, TOKEN))
    lost = TaskReport("ps:1", TaskState.NEW, node="b", tier=TierState(), copies=(Copy("ps:0", TOKEN),))
    bare = TaskReport("ps:1", TaskState.NEW, node="b", tier=TierState())
    young = TaskReport("ps:0", run_started_at=FAILED_AT + 1)
    rejoin = Failure(FAILED_AT, new_trainer_process=False)
    memory = Memory(50, TOKEN)
    return {
        "only-waited": (Facts((ps,), options=Options(restart_ps=False)), "ps:0"),
        "trainer": (Facts((TaskReport("chief:0"),)), "chief:0"),
        "not-restarted": (Facts((TaskReport("worker:0"),), failure=rejoin), "worker:0"),
        "new-agent": (Facts((bare,)), "ps:1"),
        "started-after": (Facts((young,), failure=Failure(FAILED_AT)), "ps:0"),
        "survivor-kept": (Facts((ps,), failure=rejoin, options=Options(keep_survivors=True)), "ps:0"),
        "restart": (Facts((ps,), failure=Failure(FAILED_AT)), "ps:0"),
        "own-tier": (Facts((ps,), memory), "ps:0"),
        "peer-copy": (Facts((ps, lost), memory), "ps:1"),
        "no-copy": (Facts((ps, bare), memory, Durable.at(40)), "ps:1"),
        "memory": (Facts((ps,), memory, Durable.at(40)), "restore"),
        "log-newer": (Facts((ps,), Memory(30, TOKEN), Durable.at(40)), "restore"),
        "memory-not-held": (Facts((ps, bare), memory, Durable.at(40)), "restore"),
        "memory-damaged": (Facts((ps,), Memory(50, TOKEN, loads=False), Durable.at(40)), "restore"),
        "no-memory": (Facts((ps,), None, Durable.at(40)), "restore"),
        "nothing": (Facts((ps,), None, Durable.none()), "restore"),
    }


MOMENTS = {"last-step", "reported-by-this-run"}  # decided by failure_moment and reported_moment, tested above
SHARD_RULES = {"own-tier", "peer-copy", "no-copy"}  # the rest of the task rules decide its process
THEN = {Source.MEMORY: "memory tier's token", Source.DURABLE: "the log's", Source.INITIAL: "initial values"}


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_every_rule_of_the_table_is_what_the_plan_decides(rule: object) -> None:
    name = rule.name  # type: ignore[attr-defined]
    if name in MOMENTS:
        return
    facts, who = examples()[name]
    p = plan(facts)
    if who == "restore":
        assert p.restore.rule == name and THEN[p.restore.source] in rule.then  # type: ignore[attr-defined]
    else:
        task = p.tasks[who]
        decided = (task.action.value, task.shards.value) if name in SHARD_RULES else (task.process.value,)
        assert name in task.rules and any(d in rule.then for d in decided)  # type: ignore[attr-defined]


def test_every_rule_has_an_example() -> None:
    assert set(examples()) | MOMENTS == {r.name for r in RULES}


def test_the_design_docs_table_is_the_rules() -> None:
    """docs/design.md ("Recovery plan") shows :data:`RULES` as they are: regenerate it with rules_table()."""
    design = (ROOT / "docs" / "design.md").read_text()
    tables = re.findall(r"^\| rule \| when \| then \| why \|\n(?:\|.*\n?)+", design, flags=re.M)
    assert [t.rstrip("\n") for t in tables] == [rules_table()]


def test_a_trainer_that_started_after_the_failure_is_left_alone() -> None:
    """``POST /restart`` with ``unless_started_within`` on the chief's agent: a trainer run younger than the failure
    replaced the failed one (the agent's own restart came first), so restarting it would undo that recovery; an
    older one is restarted when the failure needs a new trainer process."""
    young = TaskReport("chief", run_started_at=1001.0, role="chief")
    old = TaskReport("chief", run_started_at=999.0, role="chief")
    left = plan(Facts((young,), failure=Failure(1000.0))).tasks["chief"]
    assert left.process is Process.WAIT_FOR and left.rules == ("started-after",)
    again = plan(Facts((old,), failure=Failure(1000.0, new_trainer_process=True))).tasks["chief"]
    assert again.process is Process.RESTART
