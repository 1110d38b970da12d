"""The nemesis: injects the scenario's faults into the running cluster and storage, recording each one first.

Every fault is an operation of process ``nemesis`` in the history: its invoke (what, on which task, and the
pids it is about to signal) is written and fsynced *before* the signal is sent or the byte flipped, its
completion after. Pids come from the agents' ``/status`` (``pid`` is the task, ``agent_pid`` the agent), read at
the moment of the fault, so a task restarted by its agent is hit in its current incarnation. Faults that last
(a pause, a dead agent, a storage outage) get a heal operation when their ``duration`` is over; before the
run ends every open fault is healed, as Jepsen's final phase does.

Every fault and heal fires on its schedule whatever another one is waiting for: each runs on a thread of its own
(a heal on a timer from its fault's end), and :meth:`Nemesis.tick` only starts them. An action that waits (a
restarted agent's start, a storage server's) records its completion when it ends, later in the history; each
operation carries an ``op_id`` so that two of one kind open at once (two PS agents restarting) pair correctly.
(The nemesis once ran them in turn: a 20 s storage outage was healed only after a restarted chief agent's start
ended, 75 s after the store went down.) Those threads live until :meth:`Nemesis.close`: a storage server started
under a parent-death signal (``setpriv --pdeathsig``, :mod:`psguard.testbed.s3_server`) dies with the *thread* that
started it, and one restarted by a heal's short-lived thread died the moment its heal was done.

A fault "during" a moment of the chief agent's persister (``first-base``, ``persist``, ``compaction``, ``gc``:
:data:`psguard.chaos.scenario.AGENT_MOMENTS`; and ``durable-commit``, any write of it after the fault's step: a
durable commit the trainer asked for) is due at its step or time and then waits, on its own thread, for that
moment, while later faults fire on their own schedule: it polls the chief agent's ``/status``
(``persister.in_flight`` and ``phase``), every :data:`IDLE_POLL` seconds while the persister is idle and every
:data:`BUSY_POLL` while it writes, has requests, was asked for a durable commit in the last :data:`ASKED_BUSY`
seconds (the runner sees the trainer's ask up to 0.1 s late) or before the first base (which a small job writes
in milliseconds), and strikes when the phase comes. A write over between two looks (``checkpoints_written``
rose) is counted (``writes_unseen``) and the next one waited for. Its record says what was found
(``moment_found``; false after :data:`MOMENT_WAIT` seconds, or once the log has its first base for
``first-base``: the fault then fires anyway and faults-injected says it was not the one asked for). A wait the
run's end overtakes (:meth:`Nemesis.job_ended`, the final phase) is recorded as not injected. Either way the
record says ``missed``: the moment did not come while the case could use it, which explore counts apart from
its findings. (A fault "during a durable-commit" once became due only when the runner saw the trainer's ask,
blocking every later fault until then, and watched the persister 10 s: a fast local write was over before the
first look, and a commit further off than 10 s was never found.)

A fault "during a restore" (a PS or worker lost while a trainer loads) is held once due until the runner reports a
trainer's restore in flight; later faults pass it, and one still held at the run's end is recorded ``missed``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Protocol

from psguard.agent.process.launcher import AgentProcess
from psguard.chaos.history import HistoryWriter
from psguard.chaos.http_faults import HttpErrorProxy
from psguard.chaos.proxy import TcpProxy
from psguard.chaos.scenario import AGENT_MOMENTS, Fault, Scenario, expand_targets

log = logging.getLogger(__name__)

__all__ = ["Nemesis", "StorageControl", "TaskProcess", "chain_members", "damage_chunk"]

NEMESIS = "nemesis"
#: Seconds between looks at the chief agent's persister while it is idle, and while it writes: a write's phase
#: lasts tens of milliseconds and more, and the chief's agent is not flooded while nothing happens.
IDLE_POLL = 0.02
BUSY_POLL = 0.002
#: Longest wait for a persister's moment: a few durable cadences of the explored jobs (a new base comes every
#: ``new_base_after`` deltas, a gc after each commit past the retention).
MOMENT_WAIT = 120.0
#: Seconds after the trainer asked for a durable commit during which its write is looked for closely: a local
#: store's write of a small job is over in tens of milliseconds, and the runner sees the ask up to 0.1 s late.
ASKED_BUSY = 1.0
#: Every moment a fault can wait for, by the phases of the chief agent's persister that are it (None: any write):
#: the persister's own (AGENT_MOMENTS) and a durable commit the trainer asked for (any write after its step).
MOMENTS: dict[str, tuple[str, ...] | None] = {**AGENT_MOMENTS, "durable-commit": None}


class TaskProcess(Protocol):
    """A task the nemesis can aim at without an agent (the baseline's plain processes): ``status()`` gives
    ``pid`` (and ``agent_pid`` None)."""

    def status(self, timeout: float = 10.0) -> dict[str, Any]: ...


class StorageControl(Protocol):
    """What the nemesis needs from a storage server it can take down (``SeaweedS3`` has it)."""

    def stop(self, timeout: float | None = None) -> None: ...

    def restart(self) -> Any: ...


def _manifest_refs(doc: Mapping[str, Any]) -> set[str]:
    body = doc.get("body", {})
    out: set[str] = set()
    for entry in body.get("tensors", {}).values():
        for chunk in entry.get("chunks", []) or []:
            out.add(chunk["hash"])
        for seg in entry.get("segments", []) or []:
            out.add(seg["ids"]["hash"])
            out.add(seg["values"]["hash"])
    return out


def chain_members(store_dir: Path) -> dict[str, tuple[str | None, set[str]]]:
    """Per checkpoint id of a local store: its parent and the chunk hashes its manifest references."""
    import json

    out: dict[str, tuple[str | None, set[str]]] = {}
    for path in sorted((store_dir / "manifests").glob("*.json")):
        doc = json.loads(path.read_text())
        body = doc.get("body", {})
        out[str(body["id"])] = (body.get("parent"), _manifest_refs(doc))
    return out


def affected_checkpoints(members: Mapping[str, tuple[str | None, set[str]]], chunk: str) -> list[str]:
    """Every checkpoint whose chain (itself, its parent, ... its base) references ``chunk``."""
    out = []
    for cid in members:
        cur: str | None = cid
        seen = 0
        while cur is not None and cur in members and seen < 10_000:
            parent, refs = members[cur]
            if chunk in refs:
                out.append(cid)
                break
            cur, seen = parent, seen + 1
    return sorted(out)


def damage_chunk(store_dir: Path, mode: str, rng: random.Random) -> dict[str, Any]:
    """Flip one bit of (``corrupt``) or cut short (``truncate``) the largest chunk of the newest checkpoint.

    The largest chunk holds embedding rows: the part a restore cannot do without. Returns what was done and
    which checkpoints it makes unusable (every one whose chain references the chunk).
    """
    members = chain_members(store_dir)
    if not members:
        raise RuntimeError(f"no checkpoint in {store_dir} to damage yet")
    newest = max(members)  # ids sort by step
    import json

    doc = json.loads((store_dir / "manifests" / f"{newest}.json").read_text())
    sizes: dict[str, int] = {}
    for entry in doc["body"]["tensors"].values():
        for chunk in entry.get("chunks", []) or []:
            sizes[chunk["hash"]] = int(chunk["size"])
        for seg in entry.get("segments", []) or []:
            sizes[seg["values"]["hash"]] = int(seg["values"]["size"])
    chunk = max(sorted(sizes), key=lambda h: sizes[h])
    path = store_dir / "chunks" / chunk[:2] / chunk
    data = bytearray(path.read_bytes())
    if mode == "corrupt":
        offset = rng.randrange(len(data))
        bit = rng.randrange(8)
        data[offset] ^= 1 << bit
        detail: dict[str, Any] = {"offset": offset, "bit": bit}
    else:
        cut = rng.randrange(len(data))
        data = data[:cut]
        detail = {"truncated_to": cut, "size": len(path.read_bytes())}
    tmp = path.with_name(path.name + ".chaos")
    tmp.write_bytes(bytes(data))
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return {
        "checkpoint": newest,
        "chunk": chunk,
        "mode": mode,
        **detail,
        "affected": affected_checkpoints(members, chunk),
    }


class Nemesis:
    """Fires the scenario's faults when their trigger comes and heals them after their duration."""

    def __init__(
        self,
        scenario: Scenario,
        faults: list[Fault],
        history: HistoryWriter,
        agents: Mapping[str, AgentProcess | TaskProcess],
        *,
        store_dir: Path | None,
        storage: StorageControl | None,
        seed: int,
        proxies: Mapping[str, TcpProxy] | None = None,
        store_errors: HttpErrorProxy | None = None,
    ) -> None:
        self.scenario = scenario
        self.pending = list(faults)
        self.held: list[Fault] = []  # due, and aimed at a restore that has not come yet
        self.history = history
        self.agents = agents
        self.store_dir = store_dir
        self.storage = storage
        self.proxies = dict(proxies or {})
        self.store_errors = store_errors  # in front of the store: its HTTP error answers (store-errors)
        self.rng = random.Random(seed ^ 0x5EED)
        self.fired: list[Fault] = []
        self._lock = threading.Lock()
        # A thread per action open at once (a heal waits for its time on one), kept until close() (the module's
        # text says why): the pool's size is no limit in practice, its idle threads are reused.
        self._pool = ThreadPoolExecutor(max_workers=256, thread_name_prefix="psguard-nemesis")
        self._actions: list[Future[None]] = []  # faults and heals started and maybe still running
        self._heal_now = threading.Event()  # the final phase: every heal due at once
        self._job_over = threading.Event()  # the job ended: a fault still waiting for its moment gives up
        self._failure: BaseException | None = None  # what an action's thread raised (a history not written)
        self._op_ids = itertools.count()
        # The trainer's durable commits as the runner saw them (tick): how many, the newest's step and when.
        self._durable_asked = threading.Condition()
        self._durable_asks = 0
        self._durable_step: int | None = None
        self._durable_asked_at = float("-inf")

    @property
    def done(self) -> bool:
        return not self.pending and not self.held and not self.healing

    @property
    def healing(self) -> bool:
        """A fault or heal is running or waiting for its time (a heal is due when its fault's duration is over)."""
        with self._lock:
            self._actions = [a for a in self._actions if not a.done()]
            return bool(self._actions)

    def tick(
        self, step: int | None, elapsed: float | None, durable_in_flight: int | None = None, *, restoring: bool = False
    ) -> None:
        """Start every fault whose trigger has come (``step``: the trainer's last reported step; ``elapsed``:
        seconds since the trainer started; ``restoring``: a trainer's restore is in flight), each on its own
        thread; never waits for one. Its heal follows on its own timer. Raises what an action raised (a history
        that could not be written stops the run)."""
        self._raise_failure()
        ready: list[Fault] = []
        if durable_in_flight is not None:  # the trainer asked for a durable commit since the last tick
            with self._durable_asked:
                self._durable_asks += 1
                self._durable_step = durable_in_flight
                self._durable_asked_at = time.monotonic()
                self._durable_asked.notify_all()
        # Faults overlap when their triggers say so (a kill during a storage outage): each fires when its step or
        # time comes, whatever is still open; the checkers attribute restores to every fault active at the time.
        while self.pending:
            fault = self.pending[0]
            due = (fault.at_step is not None and step is not None and step >= fault.at_step) or (
                fault.at_time is not None and elapsed is not None and elapsed >= fault.at_time
            )
            if not due:
                break
            self.pending.pop(0)
            # Aimed at a restore (another fault's recovery): a PS lost while the trainer loads is a cluster failure
            # to recover from again, never a reason to load an older checkpoint. Held apart until a restore is in
            # flight, so the faults after it still fire when theirs come.
            (self.held if fault.during == "restore" else ready).append(fault)
        if restoring:
            ready += self.held
            self.held = []
        for fault in ready:
            self.fired.append(fault)
            self._start(fault.action, functools.partial(self._fire, fault, step, durable_in_flight))

    def job_ended(self) -> None:
        """The job reached its end: a fault still waiting for a moment of the persister, or for a restore, will
        not see it."""
        self._job_over.set()
        self._wake_waiters()
        self._miss_held()

    def _miss_held(self) -> None:
        """Record each fault still held for a restore as ``missed``: its trigger came and no restore followed
        while the run lasted, so the case did not run as drawn (explore counts it apart, as any missed moment)."""
        held, self.held = self.held, []
        for fault in held:
            self.fired.append(fault)
            value = {"fault": fault.describe(), "trigger": fault.trigger, "moment": "restore", "missed": True}
            self._not_injected(fault.action, value, "the run ended before a restore came")

    def _wake_waiters(self) -> None:
        """A fault waiting for the trainer's durable commit looks again (the job ended, or the final phase)."""
        with self._durable_asked:
            self._durable_asked.notify_all()

    def heal_all(self) -> None:
        """Heal every open fault now and wait until every fault and heal has ended (the final phase, and on the
        way out of a failed run); then raise what an action raised."""
        self._heal_now.set()
        self._wake_waiters()
        self._miss_held()
        while True:
            with self._lock:
                running = [a for a in self._actions if not a.done()]
                self._actions = running
            if not running:  # a fault ending starts its heal first: none is left behind
                break
            wait(running)
        self._raise_failure()

    def close(self) -> None:
        """Heal what is still open and end the threads, once the servers the nemesis restarted are stopped."""
        try:
            self.heal_all()
        finally:
            self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------------------------------ scheduling
    def _start(self, name: str, action: Callable[[], None]) -> None:
        """Run ``action`` on a thread of its own; what it raises is kept for :meth:`tick` and :meth:`heal_all`."""

        def run() -> None:
            try:
                action()
            except BaseException as e:
                log.error("nemesis %s failed: %s", name, e)
                with self._lock:
                    self._failure = self._failure or e

        with self._lock:
            self._actions.append(self._pool.submit(run))

    def _heal_later(self, after: float, f: str, heal: Callable[[], dict[str, Any]], value: dict[str, Any]) -> None:
        """Heal ``after`` seconds from now (at once in the final phase), on a timer of its own."""
        due = time.monotonic() + after

        def run() -> None:
            self._heal_now.wait(max(0.0, due - time.monotonic()))
            self._run(f, value, heal)

        self._start(f, run)

    def _raise_failure(self) -> None:
        with self._lock:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    # ------------------------------------------------------------------------------------------ faults
    def _run(self, f: str, value: dict[str, Any], act: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """Record the invoke, act, record the completion (``info`` when it raised: effect unknown)."""
        value = {**value, "op_id": next(self._op_ids)}
        self.history.append(NEMESIS, "invoke", f, value)
        try:
            result = act()
        except Exception as e:
            log.warning("nemesis %s %s: %s", f, value, e)
            self.history.append(NEMESIS, "info", f, {**value, "error": str(e)[:300]})
            return None
        self.history.append(NEMESIS, "ok", f, {**value, **result})
        return result

    def _fire(self, fault: Fault, step: int | None, durable_in_flight: int | None = None) -> None:
        base: dict[str, Any] = {"fault": fault.describe(), "at_step": step, "trigger": fault.trigger}
        if fault.during == "durable-commit":
            base["durable_commit_step"] = durable_in_flight  # invoked since the last look (None: none yet)
        if fault.max_lost_steps is not None:
            base["max_lost_steps"] = fault.max_lost_steps
        if fault.during in MOMENTS:
            moment = self._await_moment(fault.during, asked=durable_in_flight is not None)
            why = moment.pop("why", None)
            if why is not None:  # the run ended first (or there is no persister to watch): nothing to aim at
                name = "storage-stop" if fault.action == "storage-outage" else fault.action  # as when injected
                self._not_injected(name, {**base, **moment, "target": fault.target}, why)
                return
            base.update(moment)
        if fault.action in ("corrupt-chunk", "truncate-chunk"):
            mode = "corrupt" if fault.action == "corrupt-chunk" else "truncate"
            store_dir = self.store_dir
            if store_dir is None:  # the scenario loader refuses this; a hand-made schedule records it as not done
                self._not_injected(fault.action, {**base, "target": "store"}, "chunk damage needs a local store")
                return
            self._run(fault.action, {**base, "target": "store"}, lambda: damage_chunk(store_dir, mode, self.rng))
            return
        if fault.action == "storage-outage":
            self._stop_storage({**base, "target": "store"}, fault.duration)
            return
        if fault.action == "store-errors":
            self._fire_store_errors(fault, {**base, "target": "store", "http_status": fault.http_status})
            return
        if fault.action in ("partition", "delay", "drop"):
            for target in expand_targets(fault.target, self.scenario.cluster):
                self._fire_on_network(fault, target, base)
            return
        for target in expand_targets(fault.target, self.scenario.cluster):
            self._fire_on_task(fault, target, base)

    def _stop_storage(self, value: dict[str, Any], duration: float) -> None:
        """Stop the store (its server, or what stands for it) now and start it again ``duration`` seconds later."""
        storage = self.storage
        if storage is None:
            self._not_injected("storage-stop", value, "there is no storage server to stop")
            return

        def stop() -> dict[str, Any]:
            storage.stop(timeout=10)
            return {}

        def start() -> dict[str, Any]:
            storage.restart()
            return {}

        if self._run("storage-stop", value, stop) is not None:
            self._heal_later(duration, "storage-start", start, {"target": "store"})

    def _not_injected(self, f: str, value: dict[str, Any], why: str) -> None:
        """Record a fault that could not be carried out (the faults-injected checker then says so)."""
        value = {**value, "op_id": next(self._op_ids)}
        self.history.append(NEMESIS, "invoke", f, value)
        self.history.append(NEMESIS, "fail", f, {**value, "error": why})

    def _fire_store_errors(self, fault: Fault, value: dict[str, Any]) -> None:
        """Every request to the store answered with ``fault.http_status`` for ``fault.duration``."""
        proxy = self.store_errors
        if proxy is None:
            self._not_injected("store-errors", value, "no HTTP proxy in front of the store")
            return

        def inject() -> dict[str, Any]:
            proxy.fail_all(fault.http_status)
            return {"endpoint": proxy.endpoint_url, "failed_before": proxy.failed}

        def heal() -> dict[str, Any]:
            proxy.heal()
            return {"failed": proxy.failed}

        if self._run("store-errors", value, inject) is not None:
            self._heal_later(fault.duration, "heal", heal, {"target": "store"})

    def _fire_on_network(self, fault: Fault, target: str, base: dict[str, Any]) -> None:
        proxy = self.proxies.get(target)
        value = {**base, "target": target}
        if proxy is None:
            self._not_injected(fault.action, value, "no proxy in front of this PS")
            return
        mode = fault.action
        if fault.action == "delay":
            value["latency"] = fault.latency

        def inject() -> dict[str, Any]:
            proxy.set_mode(mode, delay=fault.latency)  # type: ignore[arg-type]
            return {"listen_port": proxy.listen_port, "target_port": proxy.target_port}

        def heal() -> dict[str, Any]:
            proxy.set_mode("pass")
            return {}

        if self._run(fault.action, value, inject) is not None:
            self._heal_later(fault.duration, "heal", heal, {"target": target})

    def _agent(self, target: str) -> AgentProcess | TaskProcess:
        name = "chief" if target == "chief" else target.replace(":", "")
        return self.agents[name]

    def _await_moment(self, moment: str, *, asked: bool = False) -> dict[str, Any]:
        """Poll the chief agent's ``/status`` until its persister is at ``moment`` (see the module's text). Returns
        what the fault's record says of it; ``why`` (and ``moment_found`` None) when it cannot be aimed, with
        ``missed`` when the moment did not come while the run lasted. ``asked``: the trainer asked for a durable
        commit in the tick that made the fault due."""
        phases = MOMENTS[moment]
        agent = self.agents.get("chief")
        t0 = time.monotonic()
        polls = unseen = 0
        last: dict[str, Any] = {}
        written: int | None = None  # the persister's count of checkpoints written, at the last look
        found: bool | None = False
        while agent is not None and time.monotonic() - t0 < MOMENT_WAIT:
            if self._heal_now.is_set() or self._job_over.is_set():
                found = None
                break
            polls += 1
            try:
                status = agent.status(timeout=2)
            except Exception:  # the chief's agent is down (a fault restarts it): its successor is looked at
                self._job_over.wait(IDLE_POLL * 10)
                written = None
                continue
            last = status.get("persister") or {}
            if last.get("in_flight") and (phases is None or last.get("phase") in phases):
                found = True
                break
            if moment == "first-base" and status.get("durable_checkpoint") is not None:
                break  # the log has its base: the moment is past and never comes again
            count = last.get("checkpoints_written")
            if isinstance(count, int) and written is not None and count > written:
                unseen += count - written  # written between two looks: the next one is waited for
            written = count if isinstance(count, int) else None
            # Looked for closely while a write is in flight or asked for (the trainer's durable commit a moment
            # ago: a fast local write is over in milliseconds), and for a first base (from the first capture).
            busy = last.get("in_flight") or last.get("pending_requests") or moment == "first-base"
            busy = busy or asked or time.monotonic() - self._durable_asked_at < ASKED_BUSY
            asked = False
            self._job_over.wait(BUSY_POLL if busy else IDLE_POLL)
        value = {"moment": moment, "moment_found": found, "persister": last, "polls": polls,
                 "waited_s": round(time.monotonic() - t0, 3)}  # fmt: skip
        if unseen:
            value["writes_unseen"] = unseen
        if found is None:
            value["why"] = f"the run ended before a {moment} came"
            value["missed"] = True
        elif agent is None:
            value["why"] = "there is no chief agent whose persister to watch"
            value["moment_found"] = None
        elif not found:
            value["missed"] = True
        return value

    def _await_durable_ask(self, asked: bool) -> dict[str, Any]:
        """Wait until the trainer asks for a durable commit (``asked``: it did in the tick that made the fault
        due), or the job ends (then ``why`` and ``missed``): the moment of a job whose saves are its trainer's."""
        t0 = time.monotonic()
        with self._durable_asked:
            seen = self._durable_asks - (1 if asked else 0)
            over = self._job_over.is_set
            self._durable_asked.wait_for(
                lambda: self._durable_asks > seen or over() or self._heal_now.is_set(), MOMENT_WAIT
            )
            ended = self._durable_asks <= seen
            step = self._durable_step
        value: dict[str, Any] = {"moment": "durable-commit", "waited_s": round(time.monotonic() - t0, 3)}
        if ended:
            why = "the run ended before a durable-commit came" if over() or self._heal_now.is_set() else (
                f"no durable-commit came in {MOMENT_WAIT:g} s")  # fmt: skip
            return {**value, "moment_found": None, "missed": True, "why": why}
        return {**value, "durable_commit_step": step}

    def _fire_on_task(self, fault: Fault, target: str, base: dict[str, Any]) -> None:
        agent = self._agent(target)
        try:
            status = agent.status(timeout=5)
            pid, agent_pid = status.get("pid"), status.get("agent_pid")
        except Exception as e:  # the agent is down: the fault cannot be aimed; record that it was not injected
            self._not_injected(fault.action, {**base, "target": target}, str(e)[:300])
            return
        value = {**base, "target": target, "pid": pid, "agent_pid": agent_pid}
        if fault.action.endswith("-agent") and not isinstance(agent, AgentProcess):
            self._not_injected(fault.action, value, "this task runs without an agent")
            return
        if fault.action in ("kill", "terminate"):
            sig = signal.SIGKILL if fault.action == "kill" else signal.SIGTERM
            if pid is None:
                self._not_injected(fault.action, value, "the task is not running")
                return
            self._run(fault.action, {**value, "signal": sig.name}, lambda: _signal(int(pid), sig))
        elif fault.action == "hang":
            if pid is None:
                self._not_injected("hang", value, "the trainer is not running")
                return
            # The trainer's step loop blocks for good on this signal (a stuck input pipeline): no heal, its
            # agent must notice that no step is made and restart it.
            self._run("hang", {**value, "signal": "SIGUSR2"}, lambda: _signal(int(pid), signal.SIGUSR2))
        elif fault.action == "pause":
            if pid is None:
                self._not_injected("pause", value, "the task is not running")
                return
            if (
                self._run("pause", {**value, "signal": "SIGSTOP"}, lambda: _signal(int(pid), signal.SIGSTOP))
                is not None
            ):
                heal = {"target": target, "pid": pid, "signal": "SIGCONT"}
                self._heal_later(fault.duration, "resume", lambda: _resume(int(pid)), heal)
        elif fault.action in ("kill-agent", "terminate-agent") and isinstance(agent, AgentProcess):
            sig = signal.SIGKILL if fault.action == "kill-agent" else signal.SIGTERM
            done = self._run(fault.action, {**value, "signal": sig.name}, lambda: _stop_agent(agent, sig))
            if done is not None:
                self._restart_later(agent, target, fault.duration)
        elif fault.action == "pause-agent" and isinstance(agent, AgentProcess):
            apid = agent.proc.pid
            if (
                self._run("pause-agent", {**value, "signal": "SIGSTOP"}, lambda: _signal(apid, signal.SIGSTOP))
                is not None
            ):
                heal = {"target": target, "agent_pid": apid, "signal": "SIGCONT"}
                self._heal_later(fault.duration, "resume", lambda: _resume(apid), heal)

    def _restart_later(self, agent: AgentProcess, target: str, after: float) -> None:
        """The agent is down: start it again after ``after`` seconds (a node rebooting, a pod rescheduled)."""

        def restart() -> dict[str, Any]:
            agent.restart()
            return {"agent_pid": agent.proc.pid, "url": agent.wait_url(120)}

        self._heal_later(after, "start-agent", restart, {"target": target})


def _resume(pid: int) -> dict[str, Any]:
    """SIGCONT; a frozen task its agent has meanwhile killed and replaced (the probe's deadline caught the freeze)
    is gone, which is the outcome the freeze scenarios look for, not a failed heal."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        return {"replaced_by_agent": True}
    return {"replaced_by_agent": False}


def _signal(pid: int, sig: signal.Signals) -> dict[str, Any]:
    os.kill(pid, sig)
    return {}


def _stop_agent(agent: AgentProcess, sig: signal.Signals) -> dict[str, Any]:
    """SIGKILL: the agent dies at once and its task with it (parent-death signal). SIGTERM: the agent stops its
    task gracefully and exits. Either way it is reaped before the fault counts as done."""
    agent.proc.send_signal(sig)
    agent.proc.wait(60)
    return {"exit": agent.proc.returncode}
