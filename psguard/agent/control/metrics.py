"""Prometheus metrics for the agent: a tiny thread-safe registry and the names dashboards and alerts use.

Not ``prometheus_client``: the text format 0.0.4 is a page of code, not worth a dependency in every sidecar. The
names below are an interface (alerts and dashboards use them): changing one is a breaking change. Every series
is exported from the agent's start (counters at 0, :meth:`AgentMetrics.declare_task`), so an alert on a counter
needs no ``or vector(0)``. ``task`` is a task's name (``ps:0``), also for the peers the chief's agent watches.

==============================================  =========  ===========  =============================================
name                                            type       labels       meaning
==============================================  =========  ===========  =============================================
``psguard_task_restarts_total``                 counter    task         times the agent started the task again
``psguard_task_up``                             gauge      task         1 while the task's process runs
``psguard_task_healthy``                        gauge      task         1 while the task passes its probes
``psguard_crash_loop``                          gauge      task         1 once the agent gave up on a crash loop
``psguard_probe_latency_seconds``               histogram  task, probe  time each probe took (failed ones too)
``psguard_probe_failures_total``                counter    task, probe  probes that failed (timeout, refused, ...)
``psguard_last_checkpoint_step``                gauge      tier         step of the newest checkpoint per tier
                                                                        (``memory``, ``durable``)
``psguard_last_checkpoint_timestamp_seconds``   gauge      tier         when it was taken (Unix time): alert on age
``psguard_persist_lag_steps``                   gauge                   steps the durable tier is behind memory
``psguard_durable_lag_steps``                   gauge                   steps from the newest commit to the newest
                                                                        save due to be durable (0: none waits)
``psguard_durable_lag_seconds``                 gauge                   how long the oldest save due to be durable
                                                                        has waited for its commit (0: none waits)
``psguard_persist_queue_depth``                 gauge                   captures waiting to be persisted
``psguard_persisted_bytes_total``               counter                 bytes written to the durable log
``psguard_persist_failures_total``              counter                 durable writes that failed (retried later)
``psguard_recovery_seconds``                    histogram               each recovery: failure to first new step
``psguard_recoveries_total``                    counter                 recoveries completed
``psguard_lost_steps_total``                    counter                 training steps redone after recoveries
``psguard_checkpoint_stall_seconds``            histogram               training stall per save (the capture)
``psguard_hangs_total``                         counter                 trainer hangs found and restarted (chief)
``psguard_peer_copy_lag_steps``                 gauge      task         steps the holder's copy of this PS's shards
                                                                        trails its tier (NaN: no copy yet)
``psguard_peer_copy_held_bytes``                gauge      owner        bytes of another PS's shards held here (a
                                                                        parity block: owner is its group, ps:0,ps:1)
``psguard_store_wait_seconds``                  gauge                   how long the chief's agent has been waiting
                                                                        for its store to answer at start (0: not)
``psguard_build_info``                          gauge      version      1; the agent's psguard version as a label
==============================================  =========  ===========  =============================================
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from psguard import __version__

if TYPE_CHECKING:
    from psguard.agent.process.lifecycle import SupervisorEvent
    from psguard.agent.process.prober import Health, ProbeResult


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Probes: a warm GetStatus takes ~0.3 ms, a frozen server the whole deadline.
PROBE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Checkpoint stalls: from a small delta (tens of ms) to a full 2M-row table (~1 s) and worse.
STALL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Recoveries: an in-process rejoin takes 3-5 s here, a restarted trainer tens of seconds, a stuck one minutes.
RECOVERY_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def _format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def _escape(text: str, *, label: bool = False) -> str:
    out = text.replace("\\", "\\\\").replace("\n", "\\n")
    return out.replace('"', '\\"') if label else out  # a label value is quoted, a HELP text is not


def _label_text(names: Sequence[str], values: Sequence[str], extra: tuple[str, str] | None = None) -> str:
    labels = [*zip(names, values, strict=True), *([extra] if extra is not None else [])]
    pairs = [f'{n}="{_escape(v, label=True)}"' for n, v in labels]
    return "{" + ",".join(pairs) + "}" if pairs else ""


C = TypeVar("C")
M = TypeVar("M", bound="_Metric[Any]")


class _Metric(Generic[C]):
    """A metric family: one child per combination of label values, created on first use."""

    kind = ""

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        if not _NAME.match(name):
            raise ValueError(f"invalid metric name {name!r}")
        for label in labels:
            if not _LABEL.match(label) or label.startswith("__"):
                raise ValueError(f"invalid label name {label!r} for metric {name}")
        if len(set(labels)) != len(labels):
            raise ValueError(f"metric {name} lists a label twice: {labels}")
        self.name = name
        self.help = help
        self.label_names = tuple(labels)
        self._lock = threading.Lock()
        self._children: dict[tuple[str, ...], C] = {}
        if not self.label_names:
            self._children[()] = self._new_child()  # shown as 0 from the start, so rate() and alerts work

    def labels(self, **values: str) -> C:
        """The child for these label values (all of the metric's labels, by name)."""
        if set(values) != set(self.label_names):
            raise ValueError(f"metric {self.name} takes labels {self.label_names}, got {tuple(values)}")
        key = tuple(str(values[n]) for n in self.label_names)
        with self._lock:
            if (child := self._children.get(key)) is None:
                child = self._children[key] = self._new_child()
            return child

    def _unlabelled(self) -> C:
        if self.label_names:
            raise ValueError(f"metric {self.name} has labels {self.label_names}: use .labels(...)")
        return self.labels()

    def _new_child(self) -> C:
        raise NotImplementedError

    def _samples(self, child: Any) -> Iterable[tuple[str, tuple[str, str] | None, float]]:
        return [("", None, child.value)]  # a counter's or a gauge's one value

    def render(self) -> list[str]:
        with self._lock:
            children = sorted(self._children.items())
        return [f"# HELP {self.name} {_escape(self.help)}", f"# TYPE {self.name} {self.kind}"] + [
            f"{self.name}{suffix}{_label_text(self.label_names, key, extra)} {_format_value(value)}"
            for key, child in children
            for suffix, extra, value in self._samples(child)
        ]


class _CounterChild:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up; use a gauge")
        with self._lock:
            self._value += amount

    @property
    def value(self) -> float:
        with self._lock:
            return self._value


class Counter(_Metric[_CounterChild]):
    kind = "counter"

    def _new_child(self) -> _CounterChild:
        return _CounterChild()

    def inc(self, amount: float = 1.0) -> None:
        self._unlabelled().inc(amount)


class _GaugeChild(_CounterChild):
    _function: Callable[[], float] | None = None

    def set(self, value: float) -> None:
        with self._lock:
            self._value = float(value)
            self._function = None

    def set_function(self, function: Callable[[], float]) -> None:
        """Read the value at scrape time (a queue's depth), instead of keeping it up to date by hand."""
        with self._lock:
            self._function = function

    @property
    def value(self) -> float:
        with self._lock:
            function, value = self._function, self._value
        if function is None:
            return value
        try:
            return float(function())
        except Exception:
            return math.nan


class Gauge(_Metric[_GaugeChild]):
    kind = "gauge"

    def _new_child(self) -> _GaugeChild:
        return _GaugeChild()

    def set(self, value: float) -> None:
        self._unlabelled().set(value)

    def set_function(self, function: Callable[[], float]) -> None:
        self._unlabelled().set_function(function)


class _HistogramChild:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._lock = threading.Lock()
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self._sum = 0.0

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self._bounds, value)  # le: a value equal to a bound falls into it
        with self._lock:
            self._counts[index] += 1
            self._sum += value

    def snapshot(self) -> tuple[list[int], float]:
        with self._lock:
            return list(self._counts), self._sum


class Histogram(_Metric[_HistogramChild]):
    kind = "histogram"

    def __init__(
        self, name: str, help: str, labels: Sequence[str] = (), buckets: Sequence[float] = DEFAULT_BUCKETS
    ) -> None:
        if "le" in labels:
            raise ValueError(f"histogram {name} cannot have a label named 'le'")
        bounds = tuple(float(b) for b in buckets if not math.isinf(b))
        if not bounds or list(bounds) != sorted(set(bounds)):
            raise ValueError(f"histogram {name} needs increasing bucket bounds, got {buckets}")
        self.buckets = bounds  # before the base class creates the unlabelled child
        super().__init__(name, help, labels)

    def _new_child(self) -> _HistogramChild:
        return _HistogramChild(self.buckets)

    def observe(self, value: float) -> None:
        self._unlabelled().observe(value)

    def _samples(self, child: _HistogramChild) -> Iterable[tuple[str, tuple[str, str] | None, float]]:
        counts, total = child.snapshot()
        cumulative = list(itertools.accumulate(counts))
        les = [repr(b) for b in self.buckets] + ["+Inf"]
        return [("_bucket", ("le", le), n) for le, n in zip(les, cumulative, strict=True)] + [
            ("_sum", None, total),
            ("_count", None, cumulative[-1]),
        ]


class Registry:
    """The metrics one agent exposes; :meth:`render` is the body of ``/metrics``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._metrics: dict[str, _Metric[Any]] = {}

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        return self._add(Counter(name, help, labels))

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        return self._add(Gauge(name, help, labels))

    def histogram(
        self, name: str, help: str, labels: Sequence[str] = (), buckets: Sequence[float] = DEFAULT_BUCKETS
    ) -> Histogram:
        return self._add(Histogram(name, help, labels, buckets))

    def _add(self, metric: M) -> M:
        with self._lock:
            if metric.name in self._metrics:
                raise ValueError(f"metric {metric.name} is already registered")
            self._metrics[metric.name] = metric
        return metric

    def get(self, name: str) -> _Metric[Any]:
        with self._lock:
            return self._metrics[name]

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._metrics)

    def render(self) -> str:
        with self._lock:
            metrics = [self._metrics[n] for n in sorted(self._metrics)]
        return "\n".join(line for metric in metrics for line in metric.render()) + "\n"


class AgentMetrics:
    """Every standard psguard metric, created on one registry; plus the adapters the agent wires as callbacks."""

    def __init__(self, registry: Registry | None = None) -> None:
        self.registry = r = registry if registry is not None else Registry()
        c, g, h = r.counter, r.gauge, r.histogram
        self.task_restarts = c("psguard_task_restarts_total", "Times the agent started its task again.", ["task"])
        self.task_up = g("psguard_task_up", "1 while the supervised task's process runs, else 0.", ["task"])
        self.task_healthy = g("psguard_task_healthy", "1 while the task passes its health probes, else 0.", ["task"])
        self.crash_loop = g("psguard_crash_loop", "1 once the agent gave up on its task after a crash loop.", ["task"])
        self.probe_latency = h(
            "psguard_probe_latency_seconds",
            "Duration of each health probe, failed ones included.",
            ["task", "probe"],
            buckets=PROBE_BUCKETS,
        )
        self.probe_failures = c("psguard_probe_failures_total", "Health probes that failed.", ["task", "probe"])
        self.last_checkpoint_step = g(
            "psguard_last_checkpoint_step", "Training step of the newest checkpoint in each tier.", ["tier"]
        )
        self.last_checkpoint_timestamp = g(
            "psguard_last_checkpoint_timestamp_seconds", "Unix time of the newest checkpoint in each tier.", ["tier"]
        )
        self.persist_lag_steps = g(
            "psguard_persist_lag_steps", "Steps by which the durable tier trails the memory tier."
        )
        self.persist_queue_depth = g(
            "psguard_persist_queue_depth", "Captures waiting to be written to the durable log."
        )
        self.durable_lag_steps = g(
            "psguard_durable_lag_steps", "Steps from the newest durable commit to the newest save due to be durable."
        )
        self.durable_lag_seconds = g(
            "psguard_durable_lag_seconds", "Seconds the oldest save due to be durable has waited for its commit."
        )
        self.persisted_bytes = c("psguard_persisted_bytes_total", "Bytes written to the durable log.")
        self.persist_failures = c(
            "psguard_persist_failures_total", "Writes to the durable log that failed (the capture is retried later)."
        )
        self.recovery_seconds = h(
            "psguard_recovery_seconds",
            "Seconds from a failure to the first new training step.",
            buckets=RECOVERY_BUCKETS,
        )
        self.recoveries = c("psguard_recoveries_total", "Recoveries completed.")
        self.lost_steps = c("psguard_lost_steps_total", "Training steps redone because of recoveries.")
        self.checkpoint_stall = h(
            "psguard_checkpoint_stall_seconds", "Training stall caused by each checkpoint save.", buckets=STALL_BUCKETS
        )
        self.hangs = c("psguard_hangs_total", "Times the trainer made no step within its hang bound and was restarted.")
        self.peer_copy_lag_steps = g(
            "psguard_peer_copy_lag_steps", "Steps by which the peer copy of this PS's shards trails its tier.", ["task"]
        )
        self.peer_copy_held_bytes = g(
            "psguard_peer_copy_held_bytes", "Bytes of another PS's shards this agent holds as its peer copy.", ["owner"]
        )
        self.store_wait_seconds = g(
            "psguard_store_wait_seconds",
            "Seconds the agent has waited for its store to answer at start (0: not waiting).",
        )
        self.build_info = g("psguard_build_info", "Always 1; the agent's psguard version is its label.", ["version"])
        self.build_info.labels(version=__version__).set(1)

    def declare_task(self, task: str, probes: Iterable[str] = ()) -> None:
        """Export ``task``'s series at once (counters at 0, gauges at 0 until known), before anything happened."""
        self.task_restarts.labels(task=task)
        self.task_up.labels(task=task)
        self.task_healthy.labels(task=task)
        self.crash_loop.labels(task=task)
        for probe in probes:
            self.probe_failures.labels(task=task, probe=probe)
            self.probe_latency.labels(task=task, probe=probe)

    def on_supervisor_event(self, event: SupervisorEvent) -> None:
        """``Supervisor(on_event=...)`` adapter: restarts, up, crash loop."""
        kind, task = event.kind.value, event.task
        if kind in ("started", "restarted"):
            self.task_up.labels(task=task).set(1)
            self.crash_loop.labels(task=task).set(0)
            if kind == "restarted":
                self.task_restarts.labels(task=task).inc()
        elif kind == "exited":
            self.task_up.labels(task=task).set(0)
            self.task_healthy.labels(task=task).set(0)
        elif kind == "gave_up":
            self.crash_loop.labels(task=task).set(1)

    def on_probe_result(self, task: str, result: ProbeResult) -> None:
        """``HealthMonitor(on_result=...)`` adapter: latency and failures per probe."""
        self.probe_latency.labels(task=task, probe=result.probe).observe(result.latency_seconds)
        self.probe_failures.labels(task=task, probe=result.probe).inc(0 if result.ok else 1)

    def on_health(self, task: str, health: Health) -> None:
        """``HealthMonitor(on_health=...)`` adapter."""
        self.task_healthy.labels(task=task).set(1 if health.value == "healthy" else 0)

    def record_checkpoint(self, tier: str, step: int, timestamp: float) -> None:
        self.last_checkpoint_step.labels(tier=tier).set(step)
        self.last_checkpoint_timestamp.labels(tier=tier).set(timestamp)

    def record_recovery(self, seconds: float, lost_steps: int = 0) -> None:
        self.recovery_seconds.observe(seconds)
        self.recoveries.inc()
        self.lost_steps.inc(lost_steps)
