"""Policy files: the YAML format of a checkpoint policy, the presets shipped in the package, and live reloading.

A policy file (commented examples: ``psguard/policy/presets/*.yaml``, ``psguard policy show NAME``)::

    description: who this is for
    memory:   {every: 30s}                       # any of: every, every_steps, cron, continuous, young_daly
    durable:  {every: 10m}
    base:     {every: 1h, max_chain: 50, max_delta_percent: 100}
    preemption: {tiers: [memory], grace: 20s}
    retention: {keep_last: 5, keep_every_hours: 24}

Within a tier any rule given saves; a cadence that can never fire is refused. :func:`load_policy` names the file,
the key and what was expected on error, never quoting a file that is not a policy. :class:`PolicyWatcher` keeps a
running process's policy in step with its file (see its doc).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Annotated, Any, BinaryIO, Literal

from psguard.config import (
    Check,
    changed_keys,
    format_duration,
    invalid,
    load_yaml,
    loads_yaml,
    open_settings_file,
    read_settings_from,
    settings_text,
)
from psguard.errors import ConfigError
from psguard.handoff.contract import Tier
from psguard.policy.engine import (
    AnyOf,
    Cadence,
    ChainLimit,
    Continuous,
    Count,
    Cron,
    Decision,
    EveryInterval,
    EverySteps,
    PositiveDuration,
    Retention,
    SaveContext,
    SavePolicy,
    Schedule,
    YoungDaly,
    cron_problem,
)
from psguard.policy.lag import LagBound

logger = logging.getLogger(__name__)

PRESETS: Traversable = importlib.resources.files(__package__) / "presets"
"""The preset policies: package data (``psguard/policy/presets/*.yaml``), read with :mod:`importlib.resources`."""

PRESETS_DIR = Path(str(PRESETS))
"""The presets' folder on disk (psguard is installed as files, never zipped), for tools that list or copy them."""


def _cron(expr: str | None) -> Cron | None:
    if expr is None:
        return None
    if (problem := cron_problem(expr)) is not None:
        raise invalid("cron", problem, expr)
    return Cron(expr)


def _any_of(*policies: SavePolicy | None) -> SavePolicy | None:
    found = tuple(p for p in policies if p is not None)
    return None if not found else found[0] if len(found) == 1 else AnyOf(found)


@dataclass(frozen=True)
class TierSpec:
    """When to save to the memory or durable tier; any rule given saves: ``every`` (a duration), ``every_steps``,
    ``cron`` (UTC), ``continuous`` (the next save when the previous is done; ``{min_interval: 30s}`` or ``{}``),
    ``young_daly`` (:class:`psguard.policy.engine.YoungDaly`)."""

    every: Cadence | None = None
    every_steps: Count | None = None
    cron: str | None = None
    continuous: Continuous | None = None
    young_daly: YoungDaly | None = None

    def __post_init__(self) -> None:
        _cron(self.cron)

    def policy(self) -> SavePolicy | None:
        """The save policy these rules make (``None``: this tier is never saved on a schedule)."""
        return _any_of(
            None if self.every is None else EveryInterval(self.every),
            None if self.every_steps is None else EverySteps(self.every_steps),
            _cron(self.cron),
            self.continuous,
            self.young_daly,
        )


@dataclass(frozen=True)
class BaseSpec:
    """When to start a new full base (compaction): on a clock (``every``, ``cron``) or when the delta chain is
    ``max_chain`` links long or its deltas reach ``max_delta_percent`` % of the base's bytes."""

    every: Cadence | None = None
    cron: str | None = None
    max_chain: Count | None = None
    max_delta_percent: float | None = None

    def __post_init__(self) -> None:
        _cron(self.cron)
        if self.max_delta_percent is not None and not self.max_delta_percent > 0:
            raise invalid("max_delta_percent", "a percentage > 0", self.max_delta_percent)

    def policy(self) -> SavePolicy | None:
        """The save policy these rules make (``None``: never ask for a new base)."""
        limit = self.max_chain is not None or self.max_delta_percent is not None
        return _any_of(
            None if self.every is None else EveryInterval(self.every),
            _cron(self.cron),
            ChainLimit(self.max_chain, self.max_delta_percent) if limit else None,
        )


@dataclass(frozen=True)
class PreemptionSpec:
    """What to do on SIGTERM: save ``tiers`` at once (``[]``: ignore the signal) and give the save ``grace``
    seconds to become restorable before exiting. Add ``durable`` when the node itself goes away (spot VMs):
    the memory tier lives on the node."""

    tiers: tuple[Literal["memory", "durable"], ...] = ("memory",)
    grace: PositiveDuration = 20.0


@dataclass(frozen=True)
class HangSpec:
    """When a trainer that stopped making steps counts as hung (its agent dumps its stacks and restarts it):
    after ``after`` seconds, else ``median_steps`` median step times but never less than ``floor`` (tracing and a
    slow start must not look like a hang). ``enabled: false`` turns detection off."""

    enabled: bool = True
    after: PositiveDuration | None = None
    median_steps: Annotated[float, Check(lambda v: v > 0, "(> 0)")] = 50.0
    floor: PositiveDuration = 300.0

    def bound(self, median_step_seconds: float | None) -> float | None:
        """Seconds without a step after which the trainer is hung; ``None``: do not judge (yet)."""
        if not self.enabled:
            return None
        if self.after is not None:
            return float(self.after)
        if median_step_seconds is None:
            return None  # no step time measured yet: the first steps (tracing) are not judged
        return max(float(self.floor), self.median_steps * median_step_seconds)


@dataclass(frozen=True)
class PolicySpec:
    """A whole policy file. Build the engine with :attr:`schedule`; retention is :attr:`retention`."""

    description: str = ""
    memory: TierSpec = TierSpec()
    durable: TierSpec = TierSpec()
    base: BaseSpec = BaseSpec()
    preemption: PreemptionSpec = PreemptionSpec()
    retention: Retention = field(default_factory=Retention)
    hang: HangSpec = HangSpec()
    durable_lag: LagBound = field(default_factory=LagBound)

    def __post_init__(self) -> None:
        if self.memory.policy() is None and self.durable.policy() is None:
            raise invalid("durable", "a cadence for the memory or the durable tier (this policy never saves)", {})

    @functools.cached_property
    def schedule(self) -> Schedule:
        """The decision engine for this policy."""
        return Schedule(
            memory=self.memory.policy(),
            durable=self.durable.policy(),
            base=self.base.policy(),
            on_preemption=frozenset(Tier(t) for t in self.preemption.tiers),
            durable_lag=self.durable_lag,
        )

    def summary(self) -> dict[str, str]:
        """What each part does, in words (``psguard policy check``)."""
        out = dict(self.schedule.describe())
        if self.preemption.tiers:
            out["preemption"] += f" within {format_duration(self.preemption.grace)}"
        out["retention"] = self.retention.describe()
        h = self.hang
        out["hang"] = (
            "not detected"
            if not h.enabled
            else f"restart after {format_duration(h.after)} without a step"
            if h.after is not None
            else f"restart after {h.median_steps:g} median step times without a step "
            f"(at least {format_duration(h.floor)})"
        )
        return out


def preset_names() -> list[str]:
    """Names of the presets in :data:`PRESETS` (``default``, ``spot-preemptible``, ...)."""
    return sorted(p.name.removesuffix(".yaml") for p in PRESETS.iterdir() if p.name.endswith(".yaml"))


def preset_text(name: str) -> str:
    """The YAML text of preset ``name``, comments included (to copy and edit)."""
    if name not in preset_names():
        raise ConfigError(f"no preset named {name!r}; presets: {', '.join(preset_names())}")
    return (PRESETS / f"{name}.yaml").read_text(encoding="utf-8")


def load_policy(path_or_preset: str | os.PathLike[str]) -> PolicySpec:
    """Load and validate a policy file, or a preset by name (``default``) when no such file exists."""
    path = Path(path_or_preset)
    if not path.exists() and isinstance(path_or_preset, str) and path_or_preset in preset_names():
        return loads_yaml(PolicySpec, preset_text(path_or_preset), source=f"preset {path_or_preset}")
    return load_yaml(PolicySpec, path)


@dataclass(frozen=True)
class Reload:
    """What happened when the watcher looked at the file: ``applied`` (with the changed keys), ``unchanged``,
    ``rejected`` (with the error; the old policy stays) or ``deleted`` (the old policy stays). ``digest``: the
    SHA-256 of the bytes looked at (``None`` when there were none to read)."""

    outcome: Literal["applied", "unchanged", "rejected", "deleted"]
    generation: int
    changes: tuple[str, ...] = ()
    error: str | None = None
    digest: str | None = None


@dataclass(frozen=True)
class _Version:
    """One version of the policy file: the file it was read from (device, inode) and its bytes."""

    file: tuple[int, int]
    data: bytes

    @functools.cached_property
    def digest(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


class PolicyWatcher:
    """The policy of one file, kept current while the process runs: ``with PolicyWatcher(path) as policy:
    policy.decide(step, context)`` uses the policy current at each call and logs saving decisions.

    Loading fails at construction if the file is invalid. After :meth:`start`, a watchdog observer (without
    watchdog, a poll every ``poll`` seconds) notes changes; each outcome is counted in :attr:`generation` (see
    :class:`Reload`). A new policy is applied only when the file was **replaced whole** (renamed over the path, or a
    symlink swapped): a file rewritten in place may be read half-written, so it is refused and the old policy stays.
    A replacement is read once the folder is quiet for ``settle`` seconds, from one descriptor, and only if unchanged
    while read."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        clock: Callable[[], float] = time.time,
        on_reload: Callable[[Reload], None] | None = None,
        settle: float = 0.2,
        poll: float = 1.0,
    ) -> None:
        self.path = Path(path).absolute()
        self._settle = settle
        self._poll = poll
        self._clock = clock
        self._on_reload = on_reload
        self._cond = threading.Condition()
        self._stat = self._signature()
        self._held: BinaryIO | None = None
        version = self._snapshot()
        if version is None:
            raise ConfigError(f"{self.path}: changed while it was read; try again once it is written")
        self._spec = self._parse(version.data)
        self._applied: bytes = version.data  # the bytes of the policy in effect
        self._looked: tuple[int, int] = version.file  # the last file looked at: a change to it is in place
        self._seen: _Version | tuple[object, str] = version  # the last looked at: a version, deleted, an error
        self._generation = 0
        self._last: Reload | None = None
        self._last_decision: Decision | None = None
        self._observer: Any = None
        self._worker: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._last_event = 0.0

    # ---- lifecycle
    def start(self) -> PolicyWatcher:
        """Start watching the file (idempotent): a watchdog observer (if installed) and a reloading thread."""
        if self._worker is None:
            self._stop.clear()
            self._observer = _observe(self)
            self._worker = threading.Thread(target=self._run, name=f"psguard-policy-reload:{self.path.name}")
            self._worker.start()
            self.changed()  # catch an edit made between loading and watching
        return self

    @property
    def polling(self) -> bool:
        """True when the file is polled (watchdog is not installed) rather than watched."""
        return self._worker is not None and self._observer is None

    def stop(self, timeout: float = 5.0) -> None:
        """Stop watching; join both threads."""
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()
            observer.join(timeout)
        worker, self._worker = self._worker, None
        if worker is not None:
            self._stop.set()
            self._wake.set()
            worker.join(timeout)
        with self._cond:
            held, self._held = self._held, None
        if held is not None:
            held.close()

    def __enter__(self) -> PolicyWatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- state
    @property
    def spec(self) -> PolicySpec:
        """The policy in effect."""
        with self._cond:
            return self._spec

    @property
    def generation(self) -> int:
        """How many file changes were looked at (applied, rejected or deleted); see :meth:`wait_for`."""
        with self._cond:
            return self._generation

    @property
    def last_reload(self) -> Reload | None:
        """The outcome of the last change looked at."""
        with self._cond:
            return self._last

    @property
    def last_decision(self) -> Decision | None:
        """The last decision :meth:`decide` made (for status pages and metrics)."""
        return self._last_decision

    def wait_for(self, generation: int, timeout: float) -> Reload | None:
        """Wait until :attr:`generation` reaches ``generation``; the last outcome, or ``None`` on timeout."""
        with self._cond:
            return self._last if self._cond.wait_for(lambda: self._generation >= generation, timeout) else None

    def status(self) -> dict[str, Any]:
        """JSON-ready state: file, generation, last reload outcome and last decision."""
        last, decision = self.last_reload, self._last_decision
        return {
            "file": str(self.path),
            "generation": self.generation,
            "last_reload": None if last is None else {"outcome": last.outcome, "error": last.error},
            "last_decision": None if decision is None else decision.to_dict(),
        }

    # ---- deciding
    def decide(self, step: int, context: SaveContext, now: float | None = None) -> Decision:
        """:meth:`Schedule.decide` with the current policy at ``now`` (default: the watcher's clock)."""
        decision = self.spec.schedule.decide(step, self._clock() if now is None else now, context)
        self._last_decision = decision
        level = logging.INFO if decision or decision.urgent else logging.DEBUG
        if logger.isEnabledFor(level):
            tiers = ",".join(decision.to_dict()["tiers"]) or "-"
            message = "event=save_decision step=%d tiers=%s urgent=%s reason=%r"
            logger.log(level, message, step, tiers, decision.urgent, decision.reason)
        return decision

    # ---- reloading
    def changed(self) -> None:
        """Note that the file may have changed; it is re-read once quiet for ``settle`` seconds."""
        self._last_event = time.monotonic()
        self._wake.set()

    def _signature(self) -> tuple[int, int, int, int] | None:
        try:
            st = self.path.stat()  # follows a ConfigMap's symlink swap: the inode changes
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def _run(self) -> None:
        while True:
            if not self._wake.wait(None if self._observer is not None else self._poll):
                if self._stop.is_set():
                    return
                signature = self._signature()
                if signature == self._stat:
                    continue
                self._stat = signature
                self._last_event = time.monotonic()
            while (quiet := time.monotonic() - self._last_event) < self._settle:
                if self._stop.wait(self._settle - quiet):
                    return
            if self._stop.is_set():
                return
            self._wake.clear()  # an event after this sets it again: the loop comes back
            try:
                self.reload()
            except Exception:  # keep watching through a bad moment
                logger.exception("event=policy_watch_error file=%s", self.path)

    def _snapshot(self) -> _Version | None:
        """The file's bytes, read from one descriptor (:func:`open_settings_file`: a FIFO or device is refused
        unread); ``None`` when the file changed while it was read (not settled: look again later).

        The file read stays open until the next look: while it is, no other file can be given its inode number,
        so a file at the path with the same (device, inode) is this one, rewritten in place."""
        source = str(self.path)
        f = open_settings_file(source)
        try:
            data, st = read_settings_from(f, source)
            now = self._signature()
        except BaseException:
            f.close()
            raise
        if len(data) != st.st_size or now != (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns):
            f.close()
            return None
        held, self._held = self._held, f
        if held is not None:
            held.close()
        return _Version((st.st_dev, st.st_ino), data)

    def _parse(self, data: bytes) -> PolicySpec:
        source = str(self.path)
        return loads_yaml(PolicySpec, settings_text(data, source), source=source)

    def reload(self) -> Reload | None:
        """Look at the file now (the watcher's thread calls this after changes). ``None`` if what is there was
        already looked at, or is still being written (looked at again after ``settle``); otherwise the
        outcome, which is also logged and counted."""
        with self._cond:
            version: _Version | tuple[object, str] | None
            try:
                version = self._snapshot() if self.path.exists() else (None, "deleted")
            except ConfigError as e:  # not a regular file, too large, unreadable: never quoted, never applied
                version = (self._signature(), f"{e}; keeping the policy in effect")
            if version is None:
                self.changed()  # being written: settle again
                return None
            if version == self._seen or (isinstance(version, _Version) and version.data == self._applied):
                self._seen = version
                if isinstance(version, _Version):
                    self._looked = version.file
                return None
            self._seen = version
            if version == (None, "deleted"):
                result = self._record("deleted", error=f"{self.path}: file deleted; keeping the policy in effect")
                logger.warning("event=policy_file_deleted file=%s kept=previous", self.path)
            elif isinstance(version, tuple):
                result = self._reject(version[1])
            else:
                in_place, self._looked = version.file == self._looked, version.file
                result = self._reject(_IN_PLACE.format(path=self.path), version) if in_place else self._apply(version)
        if self._on_reload is not None:
            self._on_reload(result)
        return result

    def _apply(self, version: _Version) -> Reload:  # holds self._cond
        try:
            spec = self._parse(version.data)
        except ConfigError as e:
            return self._reject(str(e), version)
        changes = tuple(changed_keys(self._spec, spec))
        self._spec, self._applied = spec, version.data
        result = self._record("applied" if changes else "unchanged", changes=changes, digest=version.digest)
        logger.info("event=policy_reloaded file=%s generation=%d changes=%r", self.path, result.generation, changes)
        return result

    def _reject(self, error: str, version: _Version | None = None) -> Reload:  # holds self._cond
        result = self._record("rejected", error=error, digest=None if version is None else version.digest)
        logger.error("event=policy_rejected file=%s kept=previous error=%r", self.path, error)
        return result

    def _record(
        self, outcome: Literal["applied", "unchanged", "rejected", "deleted"], **kw: Any
    ) -> Reload:  # holds self._cond
        self._generation += 1
        self._last = Reload(outcome, self._generation, **kw)
        self._cond.notify_all()
        return self._last


_IN_PLACE = (
    "{path}: rewritten in place (the same file, other bytes): not applied, since a file written in place can be read "
    "half-written. Write the new policy to a file in the same folder and rename it over this one (mv new.yaml "
    "{path.name}), as editors' safe save and Kubernetes ConfigMaps do; keeping the policy in effect"
)


def _observe(watcher: PolicyWatcher) -> Any:
    """A started watchdog observer calling ``watcher.changed()`` on events in the file's folder; ``None`` when
    watchdog (an optional dependency: ``psguard[watch]``) is not installed, and the watcher polls instead."""
    try:
        from watchdog.events import FileSystemEvent, FileSystemEventHandler
        from watchdog.observers import Observer
    except ImportError:
        logger.info("event=policy_polling file=%s every=%ss reason=watchdog-not-installed", watcher.path, watcher._poll)
        return None

    class Handler(FileSystemEventHandler):
        def on_any_event(self, event: FileSystemEvent) -> None:
            if event.event_type not in ("opened", "closed_no_write"):
                watcher.changed()

    observer = Observer()
    observer.name = f"psguard-policy-watch:{watcher.path.name}"
    observer.schedule(Handler(), str(watcher.path.parent), recursive=False)
    observer.start()
    return observer
