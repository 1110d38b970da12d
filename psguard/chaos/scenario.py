"""A chaos scenario: the cluster, the storage, the training job, the faults and the bounds, from YAML.

Loaded with :func:`psguard.config.load_yaml`: unknown keys are rejected with the closest known one, and every
error names the file and the key path (``faults[2].at_step``). A scenario says what it proves (``proves:``)
because a run that passes is only worth what its scenario claims.

Faults fire at a training step (``at_step``: the first step the trainer reports at or past it) or at a time
(``at_time``: seconds since the trainer started). ``random:`` adds faults drawn from the run's seed, so the same
seed gives the same schedule (:meth:`Scenario.schedule`).

``peer_copies`` says whether the PS agents keep a copy of each other's shards. It changes what a PS node loss
(``kill-agent`` / ``terminate-agent`` of ``ps:N``: the agent's memory tier goes with it) may cost, and so how the
checkers judge it: without copies no memory commit made before the loss can be restored (a memory commit needs
every PS's shards) and the trainer falls back to the durable log, so the loss is bounded by the durable cadence
plus a chunk; with copies (``true``: full copies; ``parity``: a pair's XOR block, which rebuilds one lost member)
the memory tier survives the loss and the memory cadence plus a chunk is the bound.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from psguard.chaos.resources import STORE_SETTLE, THREADS_PER_RECOVERY
from psguard.config import Check, Duration, invalid, load_yaml, validate
from psguard.policy.engine import cron_problem

__all__ = [
    "ACTIONS",
    "AGENT_MOMENTS",
    "Checks",
    "ClusterSpec",
    "Fault",
    "RandomFaults",
    "SoakBounds",
    "SoakKind",
    "SoakSpec",
    "Scenario",
    "StorageSpec",
    "TrainingSpec",
    "load_scenario",
]

Action = Literal[
    "kill", "terminate", "pause", "kill-agent", "terminate-agent", "pause-agent", "corrupt-chunk",
    "truncate-chunk", "storage-outage", "partition", "delay", "drop", "hang", "store-errors",
]  # fmt: skip
NETWORK_ACTIONS = ("partition", "delay", "drop")
#: Stores reached over HTTP, where a TCP proxy in front of the server carries the network faults.
PROXIED_STORES = ("s3", "gcs")
#: Faults the nemesis carries out on the store's files: only a local store's folder is on this machine to damage.
CHUNK_ACTIONS = ("corrupt-chunk", "truncate-chunk")
ACTIONS: tuple[str, ...] = (
    "kill",  # SIGKILL the task (its agent restarts it)
    "terminate",  # SIGTERM the task
    "pause",  # SIGSTOP the task, SIGCONT after `duration`
    "kill-agent",  # SIGKILL the agent (its task dies with it); the harness starts it again after `duration`
    "terminate-agent",  # SIGTERM the agent (it stops its task and exits); started again after `duration`
    "pause-agent",  # SIGSTOP the agent alone (its task runs on), SIGCONT after `duration`
    "corrupt-chunk",  # flip one bit of a chunk of the newest durable checkpoint, on disk
    "truncate-chunk",  # cut a chunk of the newest durable checkpoint short, on disk
    "storage-outage",  # stop the storage server, start it again after `duration`
    # the store answers every request with an HTTP error (`http_status`: S3's SlowDown or InternalError, GCS's
    # backendError or internalError) for `duration`: an HTTP proxy in front of an S3 or GCS server gives them
    "store-errors",
    "partition",  # the chief and workers cannot reach a PS (a TCP proxy holds every byte) for `duration`
    "delay",  # every chunk of bytes to and from a PS is held `latency` seconds, for `duration`
    "drop",  # connections to a PS are reset and refused, for `duration`
    "hang",  # the trainer's step loop blocks forever (its process lives); its agent must find and restart it
)
#: The moments of the chief agent's persister a fault can wait for (``during``), each by the ``phase`` of its
#: write in flight as ``/status`` reports it (:class:`psguard.agent.tiers.persister.PersisterStatus`; None: any):
#: the log's first base, any persist, a new base over a chain (the agent's compaction: it rewrites the base from
#: memory instead of ``Store.compact``), and the retention after a commit (its gc).
AGENT_MOMENTS: dict[str, tuple[str, ...] | None] = {
    "first-base": ("first-base",),
    "persist": None,
    "compaction": ("base",),
    "gc": ("retention",),
}
During = Literal["durable-commit", "restore", "first-base", "persist", "compaction", "gc"]
_TARGET = re.compile(r"^(chief|ps:(\d+|\*)|worker:(\d+|\*)|store)$")
Positive = Annotated[int, Check(lambda n: n > 0, "> 0")]
NonNegative = Annotated[int, Check(lambda n: n >= 0, ">= 0")]


@dataclass(frozen=True)
class Fault:
    """One fault: what, on which task, when, for how long."""

    action: Action
    target: str = "ps:0"  # chief | ps:N | worker:N | ps:* | worker:* | store
    at_step: NonNegative | None = None
    at_time: Duration | None = None
    duration: Duration = 1.0  # pause / kill-agent / storage-outage: until the heal
    max_lost_steps: NonNegative | None = None  # the policy bound for this fault (default: see checkers)
    # Also wait until a durable commit (one the trainer asked for, while the chief agent's persister writes) or a
    # trainer's restore is in flight, or a moment of the persister (AGENT_MOMENTS; on any target, the store too).
    during: During | None = None
    latency: Duration = 0.2  # delay: seconds added to each chunk of bytes
    http_status: Annotated[int, Check(lambda n: 500 <= n <= 599, "a 5xx status")] = 503  # store-errors' answer

    def __post_init__(self) -> None:
        validate(self)
        if not _TARGET.match(self.target):
            raise invalid("target", "chief, ps:N, worker:N, ps:*, worker:* or store", self.target)
        if (self.at_step is None) == (self.at_time is None):
            raise invalid("at_step", "exactly one of at_step and at_time", (self.at_step, self.at_time))
        if self.action in NETWORK_ACTIONS and not (self.target.startswith("ps:") or self.target == "store"):
            raise invalid(
                "target", f"a PS (ps:N, ps:*) or the store for {self.action}: the proxy sits in front of them",
                self.target,
            )  # fmt: skip
        if self.during == "restore" and self.target in ("store", "chief"):
            raise invalid("during", "durable-commit for a fault on the chief or the store (restore: a PS or worker)",
                          self.during)  # fmt: skip
        if self.action in NETWORK_ACTIONS:
            return
        if self.action == "hang" and self.target != "chief":
            raise invalid("target", "chief for hang (the trainer's step loop is what hangs)", self.target)
        on_store = self.action in ("corrupt-chunk", "truncate-chunk", "storage-outage", "store-errors")
        if on_store != (self.target == "store"):
            raise invalid("target", f"'store' for {self.action}" if on_store else "a task", self.target)

    @property
    def trigger(self) -> str:
        when = f"step {self.at_step}" if self.at_step is not None else f"{self.at_time:g}s"
        return f"{when} during a {self.during}" if self.during else when

    def describe(self) -> str:
        return f"{self.action} {self.target} at {self.trigger}"


@dataclass(frozen=True)
class RandomFaults:
    """``count`` faults drawn from the seed: every ``spacing`` steps (a range) from ``first_step`` on."""

    count: Positive
    first_step: NonNegative = 50
    spacing: tuple[Positive, Positive] = (40, 80)
    actions: tuple[Action, ...] = ("kill", "pause")
    targets: tuple[str, ...] = ("ps:0", "ps:1", "worker:0")
    duration: tuple[Duration, Duration] = (1.0, 3.0)

    def __post_init__(self) -> None:
        validate(self)
        if self.spacing[0] > self.spacing[1]:
            raise invalid("spacing", "[low, high] with low <= high", list(self.spacing))
        for t in self.targets:
            if not _TARGET.match(t) or t == "store":
                raise invalid("targets", "tasks: chief, ps:N, worker:N", t)
        # Every pair the seed may draw must be a fault the nemesis can carry out: found now, not mid-run.
        for action in self.actions:
            if action in CHUNK_ACTIONS or action in ("storage-outage", "store-errors"):
                raise invalid("actions", "task faults (the store's faults go in faults:, with target store)", action)
            for t in self.targets:
                try:
                    Fault(action=action, target=t, at_step=self.first_step)
                except ValueError as e:
                    raise invalid("actions", f"an action every target can take ({t}: {e})", action) from None

    def draw(self, seed: int) -> list[Fault]:
        rng = random.Random(seed)
        step = self.first_step
        out = []
        for _ in range(self.count):
            out.append(
                Fault(
                    action=rng.choice(self.actions),
                    target=rng.choice(self.targets),
                    at_step=step,
                    duration=round(rng.uniform(*self.duration), 2),
                )
            )
            step += rng.randint(*self.spacing)
        return out


@dataclass(frozen=True)
class SoakKind:
    """One kind of fault a soak draws: an action on a target (``ps:*``: a PS drawn at random), its weight among
    the kinds, and how long it lasts (drawn from the range; pauses, outages, a node's absence)."""

    action: Action
    target: str = "ps:*"
    weight: Annotated[float, Check(lambda w: w > 0, "> 0")] = 1.0
    duration: tuple[Duration, Duration] = (1.0, 3.0)

    def __post_init__(self) -> None:
        validate(self)
        if self.duration[0] > self.duration[1]:
            raise invalid("duration", "[low, high] with low <= high", list(self.duration))
        Fault(action=self.action, target=self.target, at_time=0.0)  # a pair the nemesis can carry out


@dataclass(frozen=True)
class SoakBounds:
    """What a soak's resources may do after its warm-up, per hour of fitted slope (a week is 168 of them). A
    slope counts as over its bound only when it is over by more than two standard errors of the fit: a
    restart's step or a burst is not growth, and a short run can only show a gross leak."""

    agent_rss_pct_of_state: float = 1.0  # an agent's RSS growth per hour, in % of the job's state bytes...
    agent_rss_floor_mb: float = 8.0  # ... or this many MB, whichever is more (a tiny job's 1% is noise)
    process_rss_mb: float = 64.0  # a trainer's or server's RSS growth per hour, MB
    fds: float = 20.0  # open file descriptors per hour, any process (flat, within noise)
    threads: float = 20.0
    # TensorFlow keeps threads behind at every in-process recovery's update_server_def, in the trainer and in
    # each worker (4 on TF 2.21, whatever the cluster's size): a cost per fault their threads are judged without.
    threads_per_recovery: float = THREADS_PER_RECOVERY
    children_max: int = 4  # live child processes of any process at any time (a task, its standby, helpers)
    tmpfs_mb: float = 64.0  # spool and tier folders, MB per hour
    store_mb: float = 1024.0  # the store's bytes per hour (retention keeps it flat)...
    # ... fitted only this long after the run's start: until gc's chunk grace (600 s by default) has passed, gc can
    # delete no chunk a newer checkpoint left unreferenced, and the store grows by its write rate whatever the
    # retention (a 1 GB soak: +4 GB in its first 11 minutes, flat at 3-5 GB after).
    store_settle: Duration = STORE_SETTLE
    logs_mb: float = 64.0  # the agents' logs, MB per hour (rotation keeps them bounded)
    recovery_slowdown: float = 2.0  # a later recovery of a kind at most this many times the first of its kind...
    recovery_noise: Duration = 10.0  # ... or this many seconds slower, whichever is more

    def __post_init__(self) -> None:
        validate(self)


#: A soak's faults when the scenario lists none: the kinds the field reports for week-long jobs.
SOAK_KINDS: tuple[SoakKind, ...] = (
    SoakKind("kill", "ps:*", 2.0),
    SoakKind("kill", "worker:*", 2.0),
    SoakKind("kill", "chief"),
    SoakKind("kill-agent", "ps:*", 1.0, (1.0, 3.0)),  # a PS node lost: its agent and its PS
    SoakKind("pause", "ps:*", 1.0, (2.0, 5.0)),
)


@dataclass(frozen=True)
class SoakSpec:
    """``soak:``: faults drawn at random times (exponential gaps of mean ``mean_interval``) for the run's
    ``--duration``, none in the first ``first_after`` or the last ``quiet_tail`` seconds; resources sampled every
    ``sample_every`` seconds and their slopes judged after ``warmup`` against ``bounds``."""

    mean_interval: Duration = 60.0
    first_after: Duration = 30.0
    quiet_tail: Duration = 45.0
    kinds: tuple[SoakKind, ...] = SOAK_KINDS
    warmup: Duration = 120.0
    sample_every: Duration = 5.0
    bounds: SoakBounds = field(default_factory=SoakBounds)
    # A real Prometheus (Debian's, psguard.testbed.prometheus) scrapes every agent with the shipped scrape job and
    # evaluates the shipped alerts (integrations/prometheus/): the soak then also judges the alerts and the
    # Grafana dashboard's queries (``alerts-watched``).
    prometheus: bool = False

    def __post_init__(self) -> None:
        validate(self)
        if not self.kinds:
            raise invalid("kinds", "at least one kind of fault", [])
        if self.mean_interval <= 0 or self.sample_every <= 0:
            raise invalid("mean_interval", "> 0 (and sample_every > 0)", self.mean_interval)

    def draw(self, seed: int, duration: float, cluster: ClusterSpec) -> list[Fault]:
        """The soak's faults for ``duration`` seconds: the same seed, the same list (replayable)."""
        rng = random.Random(seed)
        weights = [k.weight for k in self.kinds]
        out: list[Fault] = []
        t = self.first_after + rng.expovariate(1.0 / self.mean_interval)
        while t < duration - self.quiet_tail:
            kind = rng.choices(self.kinds, weights)[0]
            target = rng.choice(list(expand_targets(kind.target, cluster)))
            lasts = round(rng.uniform(*kind.duration), 2)
            out.append(Fault(action=kind.action, target=target, at_time=round(t, 1), duration=lasts))
            t += lasts + rng.expovariate(1.0 / self.mean_interval)
        return out


@dataclass(frozen=True)
class ClusterSpec:
    ps: Annotated[int, Check(lambda n: 1 <= n <= 4, "1 to 4")] = 2
    workers: Annotated[int, Check(lambda n: 1 <= n <= 4, "1 to 4")] = 1

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class StorageSpec:
    # s3: a real SeaweedFS; gcs: a real GCS emulator (fake-gcs-server); hdfs: a real HDFS 2.7.3 (make hdfs-runtime)
    kind: Literal["local", "s3", "gcs", "hdfs"] = "local"

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class TrainingSpec:
    """The built-in job (:mod:`psguard.demo_trainer`): small, so a run is a minute on two cores."""

    steps: Positive = 300
    chunk: Positive = 5
    memory_every: Positive = 5
    durable_every: Positive = 25
    # ... and at least this long after the last one: a soak's durable cadence by time too, as a week-long job
    # sets it, so its store writes at a rate that does not follow a small job's step rate.
    durable_min_seconds: Duration = 0.0
    # ... or whenever a time this cron expression matches (UTC; a sixth field counts seconds: "* * * * * */20") has
    # come since the last durable save, as a policy file's ``durable: {cron: ...}``: saves where the clock says.
    durable_cron: str | None = None
    hang_after: Duration | None = None  # the trainer's hang bound (its policy's hang.after), for hang faults
    max_to_keep: Positive | None = None  # retention (a soak's store must stay bounded); default: keep every one
    new_base_after: NonNegative | None = None  # the trainer's ManagerOptions(new_base_after=): a new base after N
    vocab: Positive = 20_000
    dim: Positive = 8
    batch: Positive = 64

    def __post_init__(self) -> None:
        validate(self)
        if self.durable_cron is not None and (problem := cron_problem(self.durable_cron)) is not None:
            raise invalid("durable_cron", problem, self.durable_cron)


@dataclass(frozen=True)
class Checks:
    """Bounds the checkers hold the run to."""

    liveness: Duration = 120.0  # the target step is reached within this long after the last heal
    loss_tolerance: float = 0.05  # |final loss - fault-free final loss| (absolute)
    reference: bool = True  # compare with a fault-free run of the same job and seed (shared between scenarios)

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class Scenario:
    name: str
    proves: str
    time_limit: Duration = 300.0  # the whole run, start to clean-up; past it the run stops and fails
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    storage: StorageSpec = field(default_factory=StorageSpec)
    training: TrainingSpec = field(default_factory=TrainingSpec)
    faults: tuple[Fault, ...] = ()
    random: RandomFaults | None = None
    checks: Checks = field(default_factory=Checks)
    # The PS agents keep a copy of each other's shards (the chief's agent gets ``peers: {copies: full}``; with
    # ``parity``, ``peers: {copies: parity}``: one XOR block per pair of PS, held by a PS outside the pair, so 3 PS
    # at least): a PS node loss then keeps the memory tier. See the module docstring for how the checkers judge it.
    peer_copies: bool | Literal["parity"] = False
    # The chief's agent gets ``peers: {keep_survivors: true}``: an in-process rejoin restarts only the PS that died
    # (psguard.agent.control.peers.PeersConfig.keep_survivors); the checkers judge the run as any other.
    keep_survivors: bool = False
    soak: SoakSpec | None = None  # ``psguard chaos soak``: faults at random times for a duration

    def __post_init__(self) -> None:
        validate(self)
        if not self.faults and self.random is None and self.soak is None:
            raise invalid("faults", "at least one fault (or random: or soak:)", [])
        if self.peer_copies == "parity" and self.cluster.ps < 3:
            raise invalid("peer_copies", "parity with cluster.ps of 3 or more (a pair's parity is held outside it)",
                          self.peer_copies)  # fmt: skip
        for i, fault in enumerate(self.faults):
            _check_target(fault.target, self.cluster, f"faults[{i}].target")
            if fault.at_step is not None and fault.at_step >= self.training.steps:
                raise invalid(
                    f"faults[{i}].at_step", f"a step below training.steps ({self.training.steps})", fault.at_step
                )
            if fault.action in CHUNK_ACTIONS:
                _check_chunk_fault(fault, self, f"faults[{i}]")
            if fault.during == "gc" and self.training.max_to_keep is None:
                raise invalid(f"faults[{i}].during", "gc with training.max_to_keep set (without retention no gc runs)",
                              fault.during)  # fmt: skip
            if fault.action == "storage-outage" and self.storage.kind == "local":
                raise invalid(
                    f"faults[{i}].action",
                    "storage-outage with a storage server (storage.kind s3, gcs or hdfs)",
                    fault.action,
                )
            on_http = fault.action in NETWORK_ACTIONS or fault.action == "store-errors"
            if fault.target == "store" and on_http and self.storage.kind not in PROXIED_STORES:
                raise invalid(
                    f"faults[{i}].action", f"{fault.action} of the store only with storage.kind s3 or gcs", fault.action
                )
        for i, kind in enumerate(self.soak.kinds if self.soak is not None else ()):
            _check_target(kind.target, self.cluster, f"soak.kinds[{i}].target")
            if kind.action in CHUNK_ACTIONS:
                raise invalid(f"soak.kinds[{i}].action", "no chunk damage in a soak (it needs a step)", kind.action)
            if kind.action == "storage-outage" and self.storage.kind == "local":
                expected = "storage-outage with storage.kind s3, gcs or hdfs"
                raise invalid(f"soak.kinds[{i}].action", expected, kind.action)
            on_http = kind.action in NETWORK_ACTIONS or kind.action == "store-errors"
            if kind.target == "store" and on_http and self.storage.kind not in PROXIED_STORES:
                raise invalid(f"soak.kinds[{i}].action", f"{kind.action} of the store with s3 or gcs", kind.action)
        if self.random is not None:
            for t in self.random.targets:
                _check_target(t, self.cluster, "random.targets")
            if self.random.first_step >= self.training.steps:
                raise invalid(
                    "random.first_step", f"a step below training.steps ({self.training.steps})", self.random.first_step
                )

    @property
    def needs_proxy(self) -> bool:
        """Network faults on a PS need the TCP proxies in the path to the PS servers."""
        actions = {f.action for f in self.faults if f.target != "store"} | set(
            self.random.actions if self.random else ()
        )
        actions |= {k.action for k in (self.soak.kinds if self.soak else ()) if k.target != "store"}
        return bool(actions & set(NETWORK_ACTIONS))

    @property
    def needs_store_proxy(self) -> bool:
        """Network faults on the store (latency, resets, a cut) need a TCP proxy in front of the S3 or GCS server."""
        pairs = [(f.action, f.target) for f in self.faults]
        pairs += [(k.action, k.target) for k in (self.soak.kinds if self.soak else ())]
        return any(action in NETWORK_ACTIONS and target == "store" for action, target in pairs)

    @property
    def needs_store_errors(self) -> bool:
        """HTTP error answers from the store (``store-errors``) need an HTTP proxy in front of the S3 or GCS server."""
        actions = [f.action for f in self.faults] + [k.action for k in (self.soak.kinds if self.soak else ())]
        return "store-errors" in actions

    def schedule(self, seed: int) -> list[Fault]:
        """The faults in firing order: the fixed ones plus those drawn from ``seed`` (same seed, same list)."""
        faults = list(self.faults) + (self.random.draw(seed) if self.random is not None else [])
        return sorted(faults, key=lambda f: (f.at_step if f.at_step is not None else -1, f.at_time or 0.0))


def _check_chunk_fault(fault: Fault, scenario: Scenario, key: str) -> None:
    """A chunk fault needs a store folder the nemesis can write (``storage.kind: local``) and a checkpoint to
    damage: it must fire by step, after the first capture (taken after the first chunk of steps, durable) has
    had a report in which to commit. Refused when the scenario loads, not 30 s into the run."""
    if scenario.storage.kind != "local":
        raise invalid(
            f"{key}.action",
            f"{fault.action} only with storage.kind local (the nemesis damages files in the store's folder; "
            f"it cannot reach into {scenario.storage.kind})",
            fault.action,
        )
    if fault.at_step is None:
        raise invalid(f"{key}.at_step", f"a step for {fault.action} (a time cannot say a checkpoint exists yet)", None)
    first = scenario.training.chunk
    if fault.at_step <= first:
        raise invalid(
            f"{key}.at_step",
            f"a step past {first} for {fault.action}: no checkpoint exists before the first capture, at step "
            f"{first} (training.chunk), has committed",
            fault.at_step,
        )


def _check_target(target: str, cluster: ClusterSpec, key: str) -> None:
    role, _, index = target.partition(":")
    if not index or index == "*":
        return
    count = {"ps": cluster.ps, "worker": cluster.workers}.get(role, 1)
    if int(index) >= count:
        raise invalid(key, f"an index below {count} (cluster.{role if role == 'ps' else 'workers'})", target)


def load_scenario(path: str | Path) -> Scenario:
    return load_yaml(Scenario, path)


def expand_targets(target: str, cluster: ClusterSpec) -> Sequence[str]:
    """``ps:*`` -> ``ps:0, ps:1, ...``; anything else is itself."""
    role, _, index = target.partition(":")
    if index == "*":
        return [f"{role}:{i}" for i in range(cluster.ps if role == "ps" else cluster.workers)]
    return [target]
