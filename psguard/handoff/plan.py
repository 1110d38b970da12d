"""Recovery as one plan: from what the agents report and the failure's facts, what each task does and which state
everyone restores.

Every process carries out its part of the plan and decides nothing else:

- the trainer says when its failed generation last ran (:func:`failure_moment`) and restores the plan's state,
  planning again as it learns more (a snapshot that did not load, the agents' refusal of the log:
  :mod:`psguard.trainer.restoring`);
- the chief's agent keeps only the moment reported by the run that asked for a restart (:func:`reported_moment`),
  then restarts, waits for or keeps each peer (:mod:`psguard.agent.control.peers`) and has an agent whose tier
  is lost fetch its shards from the peer holding its copy (:mod:`psguard.agent.tiers.shard_client`);
- a PS agent asked to restart its task leaves a run that began after the failure alone
  (:mod:`psguard.agent.recovery`), and loads no checkpoint over a newer state that the plan restores
  (:meth:`RecoveryPlan.loses`, :mod:`psguard.agent.tiers.spool_server`).

Pure: no I/O and no clock. Times are inputs on the planner's clock (an agent's uptime becomes a start on the
chief's clock as ``asked_at - uptime``). A fact nobody asked for is ``None``, and the plan presumes what today's
protocol presumes: a tier not asked holds what it held, a copy whose state is not known is asked for. The rules
are :data:`RULES`, one row each; the table in docs/design.md ("Recovery plan") is :func:`rules_table`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from psguard.handoff.contract import EXIT_RESTART


class TaskState(enum.StrEnum):
    """A task's process, as its agent reports it."""

    UP = "up"  # its process runs
    DOWN = "down"  # no process: exited, stopped, given up
    HUNG = "hung"  # its process runs and fails its probes
    RESTARTING = "restarting"  # its agent is replacing the process (the crash backoff, a stop under way)
    NEW = "new"  # its agent has not started it yet: a replacement node's agent


class Process(enum.StrEnum):
    KEEP = "keep"  # left as it runs, not waited for
    RESTART = "restart"
    WAIT_FOR = "wait-for"  # not restarted; the generation waits until it serves


class Shards(enum.StrEnum):
    """Where a PS's shards of the restored state come from."""

    OWN = "own tier"
    PEER = "peer copy"
    LOG = "durable log"
    NONE = "none"  # not a PS, or initial values


class Action(enum.StrEnum):
    """A task's part in one word: its process's action, unless its shards come from elsewhere."""

    KEEP = "keep"
    RESTART = "restart"
    WAIT_FOR = "wait-for"
    FETCH_FROM_PEER = "replace-and-fetch-from-peer"
    RESTORE_FROM_LOG = "restore-from-log"


class Source(enum.StrEnum):
    MEMORY = "memory"
    DURABLE = "durable"
    INITIAL = "initial"


# ------------------------------------------------------------------------------------------------ the rules
@dataclass(frozen=True)
class Rule:
    """One row of the plan: when its facts hold, what follows, and why."""

    name: str
    when: str
    then: str
    why: str


LAST_STEP = Rule(
    "last-step",
    "the trainer saw its cluster fail",
    "the failure moment is the last step a manager of the failed generation saw, else when the failure was seen",
    "a generation reaches every PS before its first step, so a PS started after any of its steps holds none of "
    "its state; the failure is often seen after the dead PS's agent swapped in its standby",
)
REPORTED_BY_THIS_RUN = Rule(
    "reported-by-this-run",
    "the trainer's run ended with a restart to follow",
    "the reported moment counts only when this run reported it and exited 75; otherwise it is unknown",
    "a report from an earlier run, or a crash, says nothing of which PS holds this run's state",
)
ONLY_WAITED = Rule(
    "only-waited",
    "the generation restarts no task (the job's start, peers.restart_ps off)",
    "wait-for",
    "the peers are brought to a known state, not replaced",
)
TRAINER = Rule(
    "trainer",
    "the chief's trainer",
    "restart for a new trainer process (its agent's supervisor does), keep for an in-process rejoin",
    "the trainer rebuilds and restores whatever its process",
)
NOT_RESTARTED = Rule(
    "not-restarted",
    "a worker when the trainer rejoins in process (or peers.restart_workers is off), any role but PS and worker",
    "keep",
    "a worker holds no variables; only a new trainer process meets an earlier one's tables on it",
)
NEW_AGENT = Rule(
    "new-agent",
    "its agent has not started the task yet (a replacement node)",
    "wait-for",
    "a task not started holds nothing of any generation",
)
STARTED_AFTER = Rule(
    "started-after",
    "its run began after the failure moment",
    "wait-for",
    "the failed generation connected to it before that moment: the run holds none of its state; a restart "
    "would kill the standby's quick start",
)
SURVIVOR_KEPT = Rule(
    "survivor-kept",
    "a PS serving through the failure, peers.keep_survivors on, the trainer rejoining in process",
    "keep",
    "the failed generation's variables on it are freed by the trainer's own collection",
)
RESTART = Rule(
    "restart",
    "any other PS, or a worker when a new trainer process follows",
    "restart",
    "it may hold the failed generation's context, which nothing else can drop",
)
OWN_TIER = Rule(
    "own-tier",
    "a PS whose agent's tier holds the memory tier's token",
    "its shards from its own tier",
    "no copy travels",
)
PEER_COPY = Rule(
    "peer-copy",
    "a PS whose tier is lost or at another state, with a copy at the token (or not known not to be) on a holder "
    "whose node lives (parity: every other member of its group at the token)",
    "replace-and-fetch-from-peer",
    "a peer's memory is newer and faster than the log",
)
NO_COPY = Rule(
    "no-copy",
    "a PS whose tier is lost or at another state, and no usable copy (none, its holder lost with it, parity "
    "with another member lost)",
    "restore-from-log; the whole restore falls to the log",
    "the tiers hold one consistent state each or none",
)
MEMORY = Rule(
    "memory",
    "the memory tier's state can be brought to every PS, loads, and is at least as new as the log's newest "
    "commit (or the log did not answer)",
    "everyone restores the memory tier's token",
    "the newest state, without a storage read",
)
LOG_NEWER = Rule(
    "log-newer",
    "the log's newest commit is newer than the memory tier",
    "everyone restores the log's newest commit",
    "another writer committed after this agent's tier",
)
MEMORY_NOT_HELD = Rule(
    "memory-not-held",
    "a PS cannot be brought to the memory tier's state",
    "everyone restores the log's newest commit that loads",
    "the log is the newest state every PS can be brought to",
)
MEMORY_DAMAGED = Rule(
    "memory-damaged",
    "the memory tier's state did not load on a PS (a damaged file)",
    "everyone restores the log's newest commit, forced into the tiers",
    "retrying the same files would fail every generation the same way",
)
NO_MEMORY = Rule(
    "no-memory",
    "no memory tier state (empty, no agent, its export failed)",
    "everyone restores the log's newest commit that loads; the agents refuse it while every PS still gives a "
    "newer memory state, and the trainer asks the memory tier again",
    "a failed export says nothing of the tiers; loading the log over them would lose acknowledged saves",
)
NOTHING = Rule(
    "nothing",
    "no usable memory state and the log answered that it holds no commit",
    "initial values",
    "a first start: nothing acknowledged exists",
)

#: Every rule, in the order the plan applies them: the order they are defined in above.
RULES: tuple[Rule, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, Rule))


def rules_table() -> str:
    """:data:`RULES` as the Markdown table in docs/design.md."""
    rows = ["| rule | when | then | why |", "| --- | --- | --- | --- |"]
    rows += [f"| `{r.name}` | {r.when} | {r.then} | {r.why} |" for r in RULES]
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------------ the facts
@dataclass(frozen=True)
class TierState:
    """A memory tier's state: ``token`` ``None`` when it holds none."""

    step: int | None = None
    token: str | None = None


@dataclass(frozen=True)
class Copy:
    """A copy of a PS's shards on another PS's agent: ``token`` the state it holds (``None``: not known, the holder
    answers when asked); ``group`` the parity group's members (empty for a full copy)."""

    holder: str
    token: str | None = None
    group: tuple[str, ...] = ()


@dataclass(frozen=True)
class TaskReport:
    """What a task's agent reports. ``run_started_at`` on the planner's clock (``None``: no run); ``tier`` the
    agent's shard tier (``None``: not asked); ``copies`` of its shards (``None``: kept, where not known)."""

    task: str
    state: TaskState = TaskState.UP
    run_started_at: float | None = None
    ready: bool = False
    node: str | None = None
    tier: TierState | None = None
    copies: tuple[Copy, ...] | None = ()
    role: str = ""  # default: the task's job (``ps`` of ``ps:0``)

    def __post_init__(self) -> None:
        if not self.role:
            object.__setattr__(self, "role", self.task.split(":", 1)[0])


@dataclass(frozen=True)
class Memory:
    """The chief's memory tier. ``step`` ``None``: not known (the agents said only that it is newer than the log);
    ``held``: every PS can be given it (``None``: not known, or judged from the task reports); ``loads`` False once
    it failed to load on a PS."""

    step: int | None
    token: str | None = None
    held: bool | None = None
    loads: bool = True


@dataclass(frozen=True)
class Durable:
    """The durable log's newest commit; ``known`` False when the store was not asked or did not answer."""

    step: int | None = None
    checkpoint: str | None = None
    known: bool = False

    @classmethod
    def at(cls, step: int, checkpoint: str | None = None) -> Durable:
        return cls(step, checkpoint, known=True)

    @classmethod
    def none(cls) -> Durable:
        return cls(known=True)


@dataclass(frozen=True)
class Failure:
    """``at``: a moment the failed generation still ran (``None``: not known, every PS is restarted); ``tasks``
    seen failed; ``nodes`` lost with their agents; ``new_trainer_process``: the next trainer is a new process."""

    at: float | None = None
    tasks: frozenset[str] = frozenset()
    nodes: frozenset[str] = frozenset()
    new_trainer_process: bool = True


@dataclass(frozen=True)
class Options:
    """The ``peers:`` settings a plan reads."""

    restart_ps: bool = True
    restart_workers: bool = True
    keep_survivors: bool = False


@dataclass(frozen=True)
class Facts:
    tasks: tuple[TaskReport, ...] = ()
    memory: Memory | None = None
    durable: Durable = field(default_factory=Durable)
    failure: Failure = field(default_factory=Failure)
    options: Options = field(default_factory=Options)


# ------------------------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class TaskPlan:
    """One task's part: ``holder`` the task whose agent holds the copy to fetch (``None``: the placement's);
    ``tier_lost``: its own tier cannot give the memory tier's state."""

    task: str
    process: Process
    shards: Shards
    why: str
    rules: tuple[str, ...]
    holder: str | None = None
    tier_lost: bool = False

    @property
    def action(self) -> Action:
        if self.shards is Shards.PEER:
            return Action.FETCH_FROM_PEER
        if self.shards is Shards.LOG and self.tier_lost:
            return Action.RESTORE_FROM_LOG
        return Action(self.process.value)


@dataclass(frozen=True)
class Restore:
    """The state everyone restores: the memory tier's ``token``, or the log's ``checkpoint`` (``None``: the
    newest that loads); ``force``: into the tiers whatever they hold."""

    source: Source
    step: int | None
    why: str
    rule: str
    token: str | None = None
    checkpoint: str | None = None
    force: bool = False


@dataclass(frozen=True)
class RecoveryPlan:
    tasks: Mapping[str, TaskPlan]
    restore: Restore

    def loses(self, step: int | None) -> bool:
        """Whether restoring a state of ``step`` instead would lose acknowledged saves: the plan restores a newer
        memory state (at equal steps nothing is lost)."""
        newer = self.restore.step
        return self.restore.source is Source.MEMORY and (newer is None or step is None or step < newer)


def failure_moment(seen_at: float, ran_at: float | None) -> float:
    """:data:`LAST_STEP`: the moment the chief's agent compares PS runs with."""
    return seen_at if ran_at is None else min(seen_at, ran_at)


def reported_moment(reported_at: float | None, *, run_started_at: float, exit_code: int | None) -> float | None:
    """:data:`REPORTED_BY_THIS_RUN`: the failure moment a trainer run's end leaves, or ``None``."""
    return None if exit_code != EXIT_RESTART or reported_at is None or reported_at < run_started_at else reported_at


def plan(facts: Facts) -> RecoveryPlan:
    """One action per reported task and the state everyone restores (see :data:`RULES`)."""
    by_task = {r.task: r for r in facts.tasks}
    token = facts.memory.token if facts.memory is not None else None
    sources = {t: _shards(r, by_task, token, facts.failure) for t, r in by_task.items() if r.role == "ps"}
    restore = _restore(facts, sources)
    tasks = {t: _task_plan(r, facts, sources.get(t), restore) for t, r in by_task.items()}
    return RecoveryPlan(tasks, restore)


_Source = tuple[Shards, Rule, str | None, bool]  # shards, rule, holder, own tier lost


def _agent_lost(r: TaskReport, failure: Failure) -> bool:
    """Its agent's memory is gone: its node lost, or a new agent (whose tier, and copies, are empty)."""
    lost_node = r.node is not None and r.node in failure.nodes
    empty = r.tier is not None and r.tier.token is None
    return lost_node or empty or (r.state is TaskState.NEW and r.tier is None)


def _at(r: TaskReport | None, token: str | None, failure: Failure) -> bool:
    """Its own tier gives state ``token`` (a tier not asked is presumed to)."""
    if r is None:
        return True
    if _agent_lost(r, failure):
        return False
    return r.tier is None or token is None or r.tier.token == token


def _usable(c: Copy, owner: str, by_task: Mapping[str, TaskReport], token: str | None, failure: Failure) -> bool:
    holder = by_task.get(c.holder)
    if c.token not in (None, token) or (holder is not None and _agent_lost(holder, failure)):
        return False
    return all(_at(by_task.get(m), token, failure) for m in c.group if m != owner)


def _shards(r: TaskReport, by_task: Mapping[str, TaskReport], token: str | None, failure: Failure) -> _Source:
    """Where a PS's shards of the memory tier's state can come from (:data:`OWN_TIER`, :data:`PEER_COPY`,
    :data:`NO_COPY`)."""
    if _at(r, token, failure):
        return Shards.OWN, OWN_TIER, None, False
    if r.copies is None:
        return Shards.PEER, PEER_COPY, None, True
    for c in r.copies:
        if _usable(c, r.task, by_task, token, failure):
            return Shards.PEER, PEER_COPY, c.holder, True
    return Shards.LOG, NO_COPY, None, True


def _memory_not_usable(m: Memory | None, sources: Mapping[str, _Source]) -> tuple[Rule, str] | None:
    """Why the memory tier's state cannot be restored, or None when it can."""
    if m is None or (m.step is None and m.token is None and m.held is not True):
        return NO_MEMORY, ""
    if not m.loads:
        return MEMORY_DAMAGED, ""
    unheld = sorted(t for t, s in sources.items() if s[0] is Shards.LOG)
    if m.held is False or (m.held is None and unheld):
        return MEMORY_NOT_HELD, f" ({', '.join(unheld)})" if unheld else ""
    return None


def _restore(facts: Facts, sources: Mapping[str, _Source]) -> Restore:
    m, d = facts.memory, facts.durable
    logged = f"the log's step {d.step}" if d.step is not None else "no commit" if d.known else "the log not asked"
    not_usable = _memory_not_usable(m, sources)
    if not_usable is None:
        assert m is not None
        if d.step is not None and m.step is not None and m.step < d.step:
            why = f"{LOG_NEWER.why}: memory step {m.step} < {logged}"
            return Restore(Source.DURABLE, d.step, why, LOG_NEWER.name, checkpoint=d.checkpoint)
        why = f"{MEMORY.why}: memory step {m.step if m.step is not None else '(newer)'} against {logged}"
        return Restore(Source.MEMORY, m.step, why, MEMORY.name, token=m.token)
    rule, detail = not_usable
    if d.known and d.step is None:
        return Restore(Source.INITIAL, None, f"{NOTHING.why} ({rule.name}{detail}, {logged})", NOTHING.name)
    why = f"{rule.why}{detail}: {logged}"
    return Restore(Source.DURABLE, d.step, why, rule.name, checkpoint=d.checkpoint, force=rule is MEMORY_DAMAGED)


def _process(r: TaskReport, facts: Facts) -> tuple[Process, Rule]:
    options, failure = facts.options, facts.failure
    if not options.restart_ps:
        return Process.WAIT_FOR, ONLY_WAITED
    started_after = failure.at is not None and r.run_started_at is not None and r.run_started_at > failure.at
    if r.role == "chief":
        if started_after:  # that trainer replaced the failed one: restarting it would undo the recovery under way
            return Process.WAIT_FOR, STARTED_AFTER
        return (Process.RESTART if failure.new_trainer_process else Process.KEEP), TRAINER
    workers = failure.new_trainer_process and options.restart_workers
    if r.role != "ps" and not (r.role == "worker" and workers):
        return Process.KEEP, NOT_RESTARTED
    if r.state is TaskState.NEW:
        return Process.WAIT_FOR, NEW_AGENT
    if started_after:
        return Process.WAIT_FOR, STARTED_AFTER
    survivor = r.role == "ps" and failure.at is not None and r.task not in failure.tasks
    serving = r.ready and r.state is TaskState.UP
    if survivor and serving and options.keep_survivors and not failure.new_trainer_process:
        return Process.KEEP, SURVIVOR_KEPT
    return Process.RESTART, RESTART


def _task_plan(r: TaskReport, facts: Facts, source: _Source | None, restore: Restore) -> TaskPlan:
    process, rule = _process(r, facts)
    if source is None or restore.source is Source.INITIAL:
        return TaskPlan(r.task, process, Shards.NONE, rule.why, (rule.name,))
    shards, shard_rule, holder, lost = source
    if restore.source is Source.MEMORY:
        why = f"{rule.why}; {shard_rule.why}"
        return TaskPlan(r.task, process, shards, why, (rule.name, shard_rule.name), holder, lost)
    # Every PS loads its rows of the log's checkpoint; the one whose tier and copies are gone is why.
    named = shard_rule.name if shards is Shards.LOG else restore.rule
    return TaskPlan(r.task, process, Shards.LOG, f"{rule.why}; {restore.why}", (rule.name, named), None, lost)
