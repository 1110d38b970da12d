"""``psguard chaos soak SCENARIO --duration 1h``: a week of faults compressed into an hour, judged as a whole.

The jobs psguard exists for run for a week: thousands of captures, hundreds of durable saves and gcs, tens of
faults. What a week does that a few minutes of chaos cannot show is growth: an agent's memory, threads, open
files or child processes creeping up per capture or per restart; tmpfs files a fault left behind; a store that
outgrows its retention; logs that fill a disk; a recovery that gets slower each time. A soak is a chaos run
(:mod:`psguard.chaos.runner`, every per-fault checker included) with three differences:

- **Faults at random times**, drawn from the scenario's ``soak.kinds`` with exponential gaps of mean
  ``soak.mean_interval`` for ``--duration`` (:meth:`~psguard.chaos.scenario.SoakSpec.draw`): the seed is printed
  and the same seed replays the same schedule.
- **Resources sampled** every ``soak.sample_every`` seconds (:mod:`psguard.chaos.resources`) for every psguard
  process by role (``agent:ps0``, ``server:ps:0``, ``trainer``: pids change across restarts, roles do not) and
  for the folders that must stay bounded (spool, PS tiers, store, logs), each sample a ``resources`` record of
  the history, so ``psguard chaos check`` judges a finished soak again from its history alone.
- **An end by time**: once ``--duration`` is over, the harness names the last step (``finish.json``, read by
  the trainer at each chunk) and the run ends when the trainer reaches it. The soak checkers then judge slopes
  after ``soak.warmup`` against ``soak.bounds`` (``resources-bounded``) and each recovery against the first of
  its kind (``recoveries-not-slower``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psguard.chaos.resources import ResourceSampler
from psguard.chaos.runner import DEFAULT_JOB, HARNESS, RunResult, _Run, run_scenario
from psguard.chaos.scenario import Scenario, SoakSpec
from psguard.errors import ConfigError

if TYPE_CHECKING:
    from psguard.testbed.prometheus import PrometheusServer

__all__ = ["check_soak", "dashboard_queries", "prometheus_config", "run_soak", "state_bytes"]

#: The trainer's ``--steps`` in a soak: never reached; the run ends at the step the harness names.
_UNBOUNDED_STEPS = 10**9
#: Steps past the last one seen that the harness asks for: a few chunks, so the end is near but not past.
_FINISH_CHUNKS = 4
#: Seconds between two listings of an S3 store (each lists every chunk: not every sample).
_LISTING_EVERY = 30.0
#: Seconds past ``--duration`` the run may take to start, finish its last steps and stop, before its time limit.
_SLACK = 900.0


def state_bytes(scenario: Scenario) -> int:
    """The job's state: the built-in model's table and its Adagrad slot, float32 (the bound of an agent's RSS
    growth is a share of it)."""
    t = scenario.training
    return int(t.vocab) * int(t.dim) * 4 * 2


def s3_usage(url: str, storage_options: Mapping[str, Any]) -> tuple[float, float]:
    """Bytes and objects under an S3 URL, from one fresh listing. Fresh: fsspec's cached instance answers from
    its listing cache, and once gc had deleted an object listed before, every later listing of the hour-long
    soaks raised FileNotFoundError: their store series held the first minute only. One listing: ``du`` also
    asked for every object's info after it, and a lock file released in between failed the whole sample."""
    import s3fs  # lazy: only an S3 soak lists its store

    options = {**storage_options, "skip_instance_cache": True, "use_listings_cache": False}
    fs = s3fs.S3FileSystem(**options)
    listed = fs.find(url.removeprefix("s3://"), detail=True)
    return float(sum(int(info.get("size") or 0) for info in listed.values())), float(len(listed))


class _SoakRun(_Run):
    """A chaos run whose faults come at random times, whose resources are sampled, and which ends by time."""

    def __init__(self, scenario: Scenario, directory: Path, *, duration: float, **kwargs: Any) -> None:
        assert scenario.soak is not None
        super().__init__(scenario, directory, **kwargs)
        self.soak: SoakSpec = scenario.soak
        self.duration = duration
        self.schedule = self.soak.draw(self.seed, duration, scenario.cluster) if kwargs.get("faults", True) else []
        self.finish_path = directory / "finish.json"
        self.finished_at_step: int | None = None
        self._finished_wall: float | None = None  # Unix time the duration ended (the dashboard is read as of it)
        self._last_sample = 0.0
        self._last_listing = 0.0
        self._listing_errors: set[str] = set()
        self.prometheus: PrometheusServer | None = None  # soak.prometheus: started with the cluster
        self._prom_started = 0.0
        self._sampler = ResourceSampler(self._processes, self._folders(), self._collect, every=self.soak.sample_every)
        self._values: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------ hooks
    def run_extra(self) -> dict[str, Any]:
        soak = {
            "duration": self.duration,
            "mean_interval": self.soak.mean_interval,
            "warmup": self.soak.warmup,
            "sample_every": self.soak.sample_every,
            "bounds": asdict(self.soak.bounds),
            "prometheus": self.soak.prometheus,
            "state_bytes": state_bytes(self.scenario),
        }
        return {"soak": soak, "target_step": None}  # the target is named at the end (``finish``)

    def trainer_extra(self) -> list[str]:
        return ["--finish-file", str(self.finish_path)]

    def on_tick(self, now: float, elapsed: float | None) -> None:
        if elapsed is None:
            return  # the trainer has not started: nothing to sample or end yet
        if now - self._last_sample >= self.soak.sample_every:
            self._last_sample = now
            self._sample(now)
        if self.finished_at_step is None and elapsed >= self.duration and self.step is not None:
            self._finish()

    def target_line(self) -> str:
        return f"training for {self.duration / 60:g} minutes, {len(self.schedule)} faults, then to a step named then"

    def progress_line(self, fired: str, elapsed: float | None) -> str:
        minutes = 0.0 if elapsed is None else elapsed / 60
        return f"  soak {minutes:.1f}/{self.duration / 60:.1f} min  step {self.step}  faults fired {fired}"

    # ------------------------------------------------------------------------------------------ sampling
    def _processes(self) -> dict[str, int]:
        """Role -> pid of every psguard process now: each agent, the task it runs (from its ``/status``), and
        this harness (its store proxy once kept every socket it opened: an hour in, the store was cut off)."""
        out: dict[str, int] = {"harness": os.getpid()}
        for name, agent in self.agents.items():
            if agent.proc.poll() is not None:
                continue
            out[f"agent:{name}"] = agent.proc.pid
            with contextlib.suppress(Exception):  # an agent between restarts: its task is sampled next time
                pid = agent.status(timeout=2.0).get("pid")
                if isinstance(pid, int):
                    out["trainer" if name == "chief" else f"server:{name}"] = pid
        return out

    def _folders(self) -> dict[str, Path]:
        folders = {"spool": self.dir / "spool", "logs": self.dir / "agents"}
        for i in range(self.scenario.cluster.ps):
            folders[f"ps{i}-shards"] = self.part_dir(i)
        if self.scenario.storage.kind == "local":
            folders["store"] = self.dir / "store"
        elif self.scenario.storage.kind == "hdfs":
            folders["store"] = self.dir / "hdfs"  # the DataNode's folder: HDFS frees a deleted block at once
        # S3: the objects the store holds, listed (_store_objects); SeaweedFS keeps a deleted object's space
        # in its volume files until a vacuum, so its data folder grew by every checkpoint retention deleted.
        return folders

    def _store_objects(self) -> tuple[float, float] | None:
        """Bytes and objects under the store's S3 URL, or ``None`` when it cannot be listed now (an outage the
        nemesis made: that sample has no store figure; the first failure of each kind is said)."""
        try:
            return s3_usage(self.store_url, self.storage_options)
        except Exception as e:
            kind = type(e).__name__
            if kind not in self._listing_errors:
                self._listing_errors.add(kind)
                self.say(f"  the store could not be listed ({kind}: {str(e)[:200]}); its samples wait for the next")
            return None

    def _collect(self, _t: float, series: str, value: float) -> None:
        self._values[series] = value

    def _sample(self, now: float) -> None:
        self._values = {}
        pids = self._sampler.sample()
        if self.scenario.storage.kind == "s3" and now - self._last_listing >= _LISTING_EVERY:
            self._last_listing = now
            listed = self._store_objects()
            if listed is not None:
                self._values["folder:store/bytes"], self._values["folder:store/files"] = listed
        self.history.append(HARNESS, "invoke", "resources", {}, at=now)
        self.history.append(HARNESS, "ok", "resources", {"values": dict(self._values), "pids": pids}, at=now)

    # ------------------------------------------------------------------------------------------ Prometheus
    def start_cluster(self) -> None:
        super().start_cluster()
        if self.soak.prometheus:
            self._start_prometheus()

    def _start_prometheus(self) -> None:
        from psguard.testbed.prometheus import PrometheusServer  # lazy: only a watched soak needs it

        if not (INTEGRATIONS / "scrape-config.yaml").is_file():
            raise ConfigError(f"soak.prometheus: the shipped Prometheus files are not here ({INTEGRATIONS})")
        targets = [str(a.url).removeprefix("http://") for a in self.agents.values() if a.url]
        token = next(iter(self.agents.values())).token_file  # the run's agents share one
        config = prometheus_config(targets, token, self.soak.sample_every)
        self.prometheus = PrometheusServer(self.dir / "prometheus", config).start()
        self._prom_started = time.time()
        self.say(f"  prometheus {self.prometheus.url} scrapes {len(targets)} agents, the shipped alerts loaded")

    def stop_all(self) -> None:
        prom = self.prometheus
        if prom is not None:
            try:
                self._record_prometheus(prom)
            finally:
                prom.stop()
        super().stop_all()

    def _record_prometheus(self, prom: PrometheusServer) -> None:
        """What Prometheus saw, as a history record: each alert's firing span (on the history's clock) and how
        many series each of the Grafana dashboard's queries returns now."""
        offset = time.time() - time.monotonic()
        self.history.append(HARNESS, "invoke", "prometheus", {})
        try:
            firing = prom.query_range('ALERTS{alertstate="firing"}', self._prom_started, time.time(), 2.0)
            alerts = [
                {"alert": s["metric"].get("alertname"), "labels": s["metric"],
                 "first": float(s["values"][0][0]) - offset, "last": float(s["values"][-1][0]) - offset}
                for s in firing if s.get("values")
            ]  # fmt: skip
            # As of the end of the duration, when every agent still ran: the chief's agent stops with its
            # trainer, and its series go stale at the next scrape, before this runs.
            at = self._finished_wall if self._finished_wall is not None else time.time()
            dashboard = {expr: len(prom.query(expr, at=at)) for expr in dashboard_queries()}
            # The tasks whose restarts held PsguardTaskRestarting's condition for two of its evaluations: the
            # alert must have fired for each of them. A shorter span (increase() extrapolates, so the value
            # wobbles around 3 as restarts leave the window) may fall between the rule's evaluations.
            bursts = prom.query_range(
                "increase(psguard_task_restarts_total[15m]) >= 3", self._prom_started, time.time(), 1.0
            )
            held = 2.0 * self.soak.sample_every
            restarted = sorted({str(b["metric"].get("task")) for b in bursts if longest_span(b["values"]) >= held})
        except Exception as e:  # evidence of a broken watch, judged as such
            self.history.append(HARNESS, "fail", "prometheus", {"error": f"{type(e).__name__}: {e}"[:500]})
            return
        value = {"alerts": alerts, "dashboard": dashboard, "restart_bursts": restarted,
                 "windows": alert_windows(), "interval": self.soak.sample_every}  # fmt: skip
        self.history.append(HARNESS, "ok", "prometheus", value)

    # ------------------------------------------------------------------------------------------ the end
    def _finish(self) -> None:
        """The duration is over: name the last step (a few chunks on) for the trainer, which ends there."""
        assert self.step is not None
        target = self.step + _FINISH_CHUNKS * self.scenario.training.chunk
        tmp = self.finish_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": target}))
        os.replace(tmp, self.finish_path)  # the trainer reads it whole or not at all
        self.finished_at_step = target
        self._finished_wall = time.time()
        self.history.append(HARNESS, "invoke", "finish", {"target_step": target})
        self.history.append(HARNESS, "ok", "finish", {"target_step": target})
        self.say(f"  soak: {self.duration / 60:.1f} min are over; training to step {target}, then the verdicts")


#: The shipped Prometheus files (the repository's integrations/prometheus/), which the soak's Prometheus loads.
INTEGRATIONS = Path(__file__).resolve().parents[2] / "integrations" / "prometheus"


def prometheus_config(targets: list[str], token_file: Path, interval: float) -> dict[str, Any]:
    """The shipped scrape job (integrations/prometheus/scrape-config.yaml) pointed at this run's agents: static
    loopback targets instead of Kubernetes discovery, plain HTTP with the run's token instead of mutual TLS, and
    an interval of ``interval`` seconds (15 s in the file) so a soak of minutes has enough samples; the shipped
    alerts as its rules, evaluated as often."""
    import yaml

    job = dict(yaml.safe_load((INTEGRATIONS / "scrape-config.yaml").read_text())["scrape_configs"][0])
    for key in ("kubernetes_sd_configs", "relabel_configs", "tls_config"):
        job.pop(key, None)
    job.update(scheme="http", scrape_interval=f"{interval:g}s", static_configs=[{"targets": targets}])
    job["authorization"] = {**job["authorization"], "credentials_file": str(token_file)}
    return {
        "global": {"scrape_interval": f"{interval:g}s", "evaluation_interval": f"{interval:g}s"},
        "rule_files": [str(INTEGRATIONS / "alerts.yaml")],
        "scrape_configs": [job],
    }


def alert_windows() -> dict[str, float]:
    """Each shipped alert's longest range (``increase(x[15m])``: 900 s): how long after its cause it may still
    fire. An alert with no range (a gauge held ``for:`` a while) must resolve once its cause is healed."""
    import re

    import yaml

    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    doc = yaml.safe_load((INTEGRATIONS / "alerts.yaml").read_text())
    windows = {}
    for group in doc.get("groups", []):
        for rule in group.get("rules", []):
            ranges = [int(n) * units[u] for n, u in re.findall(r"\[(\d+)([smhd])\]", str(rule.get("expr", "")))]
            if "alert" in rule and ranges:
                windows[str(rule["alert"])] = float(max(ranges))
    return windows


def longest_span(values: list[list[Any]], step: float = 1.0) -> float:
    """The longest run of consecutive points of a range query's series (``[time, value]`` pairs ``step``
    seconds apart; a condition's series has points only where it held), in seconds."""
    longest, start, last = 0.0, None, None
    for t, _ in values:
        t = float(t)
        if start is None or last is None or t - last > step * 1.5:
            start = t
        last = t
        longest = max(longest, last - start)
    return longest


def dashboard_queries() -> list[str]:
    """Every query of the shipped Grafana dashboard."""
    doc = json.loads((INTEGRATIONS / "grafana-dashboard.json").read_text())
    return [t["expr"] for panel in doc.get("panels", []) for t in panel.get("targets", []) if t.get("expr")]


def check_soak(scenario: Scenario, duration: float) -> None:
    """Refuse a scenario that is no soak, or a duration in which no fault could fire, before anything starts."""
    if scenario.soak is None:
        raise ConfigError(f"{scenario.name}: not a soak scenario (no soak: section); run it with psguard chaos run")
    if duration < scenario.soak.first_after + scenario.soak.quiet_tail:
        raise ConfigError(
            f"--duration {duration:g}s: shorter than the soak's first_after + quiet_tail "
            f"({scenario.soak.first_after + scenario.soak.quiet_tail:g}s): no fault could fire"
        )


def run_soak(
    scenario: Scenario,
    directory: Path,
    *,
    duration: float,
    seed: int,
    job: str = DEFAULT_JOB,
    say: Callable[[str], None] = print,
) -> RunResult:
    """Soak ``scenario`` for ``duration`` seconds in ``directory``; see the module docstring."""
    check_soak(scenario, duration)
    soaked = replace(
        scenario,
        training=replace(scenario.training, steps=_UNBOUNDED_STEPS),
        time_limit=duration + _SLACK,
        checks=replace(scenario.checks, reference=False),  # no fault-free run lasts as long to compare with
    )

    def make(s: Scenario, d: Path, **kwargs: Any) -> _SoakRun:
        return _SoakRun(s, d, duration=duration, **kwargs)

    t0 = time.monotonic()
    result = run_scenario(soaked, directory, seed=seed, job=job, say=say, run_class=make)
    say(f"soak {scenario.name}: {time.monotonic() - t0:.0f}s, seed {seed} (replay: --seed {seed})")
    return result
