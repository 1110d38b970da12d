"""The chief agent's side of the PS agents' shard tiers: one call fans out to every PS agent (issue 12), and the
peer copies' placement and node-loss restore (issue 24). The PS agent's side: :mod:`psguard.agent.tiers.shards`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from psguard.agent.tiers.shards import ShardError, StateNotHeldError
from psguard.handoff.parts import PartCapture, ShardKey
from psguard.handoff.plan import Action, Copy, Facts, Memory, TaskReport, TierState, plan

log = logging.getLogger(__name__)

#: The export answers that say what a PS agent's tier holds (any other is an error of that agent).
_TIER_ANSWERS = ("ok", "empty", "mismatch")


class ShardClient:
    """The chief agent's side: one call fans out to every PS agent, in parallel. ``peers()``: ``{task: base URL}``
    of the PS agents now; ``call``: POSTs JSON with the agents' credentials and returns the answer's JSON."""

    def __init__(
        self,
        peers: Callable[[], Mapping[str, str]],
        call: Callable[[str, Mapping[str, Any], float], Any],
        *,
        copies: str = "none",
        placement: Mapping[str, str] | None = None,
        nodes: Callable[[], Mapping[str, str | None]] | None = None,
        parity_group: int = 2,
        parity_placement: Mapping[str, str] | None = None,
    ) -> None:
        """``copies``: ``"none"``, ``"full"`` (:mod:`.peer_copy`) or ``"parity"`` (:mod:`.parity`, groups of
        ``parity_group``); ``placement`` / ``parity_placement``: owner task / ``"ps:0,ps:1"`` -> holder task;
        ``nodes``: task -> the node its agent runs on (copies never go to the same node)."""
        self._peers = peers
        self._call = call
        self.timeout = 120.0  # seconds a PS agent may take to answer
        self.copies = copies
        self.placement = dict(placement or {})
        self.parity_group = max(2, parity_group)
        self.parity_placement = dict(parity_placement or {})
        self._nodes = nodes or dict
        #: The PS tasks whose agents hold the tier's shards (those of the last capture applied), and the lock
        #: that orders captures (applied to every tier) and durable takes (taken from every tier) as one.
        self.active: tuple[str, ...] = ()
        self.order = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="psguard-shards")
        self.copy_state: dict[str, dict[str, Any]] = {}  # owner -> its copy's holder and step (apply answers)
        self.peer_restores = 0
        self.last_restore_sources: dict[str, str] = {}
        # PS task -> (state token, holder) of its last fetch from a peer's copy: where an export's shards came from.
        self._pulled: dict[str, tuple[str, str]] = {}
        self._warned: set[str] = set()

    def holders_of(self, tasks: Sequence[str], token: str) -> dict[str, str | None] | None:
        """Each PS task -> the task whose agent's copy holds state ``token`` (``None``: no copy holds it), from
        the answers of the last apply; ``None`` when copies are off."""
        if self.copies == "none":
            return None
        held = {t: self.copy_state.get(t) or {} for t in tasks}
        out: dict[str, str | None] = {t: s.get("holder") if s.get("token") == token else None for t, s in held.items()}
        if self.copies == "parity":  # a parity block holds a member's state when it holds every member's
            for members in self.parity_groups():
                states = [self.copy_state.get(m) or {} for m in members]
                whole = all(s.get("token") == token and s.get("holder") == states[0].get("holder") for s in states)
                if not whole:
                    out.update(dict.fromkeys(set(members) & set(out)))
        return out

    def parity_groups(self) -> list[tuple[str, ...]]:
        """The PS tasks in groups of ``parity_group`` by index (ps:0..ps:K-1, ps:K..., the last may be smaller),
        so a missing agent never shifts another task's group."""
        groups: dict[int, list[str]] = {}
        for t in sorted((t for t in self._peers() if t.startswith("ps:")), key=lambda t: int(t.split(":")[1])):
            groups.setdefault(int(t.split(":")[1]) // self.parity_group, []).append(t)
        return [tuple(g) for _, g in sorted(groups.items())]

    def copy_targets(self) -> dict[str, str]:
        """Owner PS task -> the PS task whose agent holds its copy (or its group's parity): the user's placement,
        else the first PS after it (its group) in index order on a node none of them is on. An owner with no such
        holder gets none (and a warning, once)."""
        if self.copies == "none":
            return {}
        peers, nodes = self._peers(), self._nodes()
        ps = sorted((t for t in peers if t.startswith("ps:")), key=lambda t: int(t.split(":")[1]))
        parity = self.copies == "parity"
        out: dict[str, str] = {}
        for members in self.parity_groups() if parity else [(t,) for t in ps]:
            key = ",".join(members)
            wanted = (self.parity_placement if parity else self.placement).get(key)
            last = ps.index(members[-1])
            taken = {nodes.get(m) or "" for m in members}
            for holder in [wanted] if wanted is not None else [ps[(last + k) % len(ps)] for k in range(1, len(ps))]:
                if holder in peers and holder not in members and (nodes.get(holder) or "?") not in taken:
                    out.update(dict.fromkeys(members, holder))
                    break
            else:
                if key not in self._warned:
                    self._warned.add(key)
                    log.warning(
                        "event=%s=%s nodes=%s: no PS agent on another node can hold its %s (placement %s); a loss "
                        "of its node restores from the durable log",
                        "parity_unplaced group" if parity else "peer_copy_unplaced task",
                        key,
                        dict(nodes),
                        "parity" if parity else "copy",
                        wanted or "ring",
                    )
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _fan_out(self, path: str, bodies: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
        peers = self._peers()
        missing = sorted(set(bodies) - set(peers))
        if missing:
            raise ShardError(f"no agent known for {missing}: is every PS run under `psguard agent`?")
        futures = {
            task: self._pool.submit(self._call, peers[task] + path, body, self.timeout) for task, body in bodies.items()
        }
        answers: dict[str, dict[str, Any]] = {}
        errors = []
        for task, f in futures.items():
            try:
                answer = f.result()
                if not isinstance(answer, dict):
                    raise ShardError("not a JSON object")
                answers[task] = answer
            except Exception as e:
                errors.append(f"{task}: {e}")
        if errors:
            raise ShardError(f"{path} failed on " + "; ".join(errors))
        return answers

    def apply(
        self, parts: Sequence[PartCapture], *, step: int, token: str, parent: str | None
    ) -> tuple[Literal["ok", "need_full", "error"], str]:
        """Forward a capture's parts; ``(status, message)``, the worst of the PS agents' answers."""
        self._pulled.clear()  # a new state: what a restore finds from now on came from the PS agents' own tiers
        targets = self.copy_targets()
        peers = self._peers() if targets else {}
        groups = {m: g for g in self.parity_groups() for m in g} if self.copies == "parity" else {}
        bodies: dict[str, dict[str, Any]] = {}
        for p in parts:
            body: dict[str, Any] = {"part": p.to_json(), "step": step, "token": token, "parent": parent}
            holder = targets.get(p.task)
            if self.copies != "none":
                body["copy_to"] = {"task": holder, "url": peers[holder]} if holder is not None else None
            if body.get("copy_to") and p.task in groups:
                group = groups[p.task]
                body["copy_to"]["parity"] = {"group": list(group), "urls": {m: peers[m] for m in group}}
            bodies[p.task] = body
        answers = self._fan_out("/shards/apply", bodies)
        for task, a in answers.items():
            if isinstance(a.get("copy"), dict):
                self.copy_state[task] = a["copy"]
            else:
                self.copy_state.pop(task, None)
        wanted: Literal["need_full", "error"]
        for wanted in ("error", "need_full"):
            bad = {t: a for t, a in answers.items() if a.get("status") == wanted}
            if bad:
                return wanted, "; ".join(f"{t}: {a.get('message', '')}" for t, a in sorted(bad.items()))
        unknown = {t: a.get("status") for t, a in answers.items() if a.get("status") != "ok"}
        if unknown:
            return "error", f"unexpected answers {unknown}"
        return "ok", ""

    def export(self, tasks: Sequence[str], token: str) -> list[dict[str, Any]]:
        """Every PS agent's restore files for state ``token``; raises when one cannot give that state. A new
        agent of a lost node first fetches its shards from a peer's copy, when the recovery plan finds one."""
        # Whether a pull may follow an answer of "empty": if not, that agent reads the log next (its store opens).
        body = {"token": token, "peer_copies": self.copies != "none"}
        answers = self._fan_out("/shards/export", dict.fromkeys(tasks, body))
        sources = {t: f"peer {p[1]}" if (p := self._pulled.get(t)) and p[0] == token else "own tier" for t in tasks}
        reports = tuple(self._report(t, a, token) for t, a in answers.items() if a.get("status") in _TIER_ANSWERS)
        parts = plan(Facts(reports, Memory(None, token))).tasks.values()
        fetch = {p.task: p.holder for p in parts if p.action is Action.FETCH_FROM_PEER and p.holder is not None}
        unheld = sorted(p.task for p in parts if p.action is Action.RESTORE_FROM_LOG)
        for t in unheld if self.copies != "none" else ():
            log.warning("event=peer_copy_none task=%s: no peer holds a usable copy; the durable log serves", t)
        if fetch and not unheld:
            pulled = self._pull_from_peers(fetch, token)
            if pulled:
                answers.update(self._fan_out("/shards/export", dict.fromkeys(pulled, body)))
                sources.update({t: f"peer {h}" for t, h in pulled.items()})
        bad = {t: f"{a.get('status')} (step {a.get('step')})" for t, a in answers.items() if a.get("status") != "ok"}
        if bad:
            gone = all(answers[t].get("status") in ("empty", "mismatch") for t in bad)
            raise (StateNotHeldError if gone else ShardError)(
                f"the PS agents do not all hold the chief's state {token}: {bad}"
            )
        self.last_restore_sources = sources
        files: list[dict[str, Any]] = []
        for task, a in sorted(answers.items()):
            if not isinstance(a.get("files"), list):
                raise ShardError(f"{task}: malformed export answer")
            files.extend({**f, "task": task} for f in a["files"])
        return files

    def _report(self, task: str, answer: Mapping[str, Any], token: str) -> TaskReport:
        """A PS agent's export answer as the recovery plan reads it: its tier's state and the copy of its shards
        (the holder the last capture's answer named, else the placement's; its state only when it was ``token``:
        a copy that lagged then may have caught up, and its holder answers)."""
        status, step = answer.get("status"), answer.get("step")
        held = answer.get("token") if status == "mismatch" else token if status == "ok" else None
        tier = TierState(step if isinstance(step, int) else None, str(held) if held is not None else None)
        copies: tuple[Copy, ...] = ()
        state = self.copy_state.get(task) or {}
        holder = state.get("holder") or self.copy_targets().get(task)
        if self.copies != "none" and holder is not None:
            group = next((g for g in self.parity_groups() if task in g), ()) if self.copies == "parity" else ()
            copies = (Copy(holder, token if state.get("token") == token else None, group),)
        return TaskReport(task, node=self._nodes().get(task), tier=tier, copies=copies)

    def _pull_from_peers(self, holders: Mapping[str, str], token: str) -> dict[str, str]:
        """Ask each lost PS's new agent to fetch its shards from the holder of its copy; the tasks that did,
        with their holder, when all did. Each failure is logged with its reason (the log is used then)."""
        peers = self._peers()
        bodies = {t: {"token": token, "holder": peers[h]} for t, h in holders.items() if h in peers}
        if not bodies:
            return {}
        try:
            answers = self._fan_out("/shards/pull", bodies)
        except ShardError as e:
            log.warning("event=peer_copy_pull_failed error=%r", str(e))
            return {}
        pulled: dict[str, str] = {}
        for t, a in answers.items():
            if a.get("status") == "ok":
                pulled[t] = holders[t]
                self._pulled[t] = (token, holders[t])
                self.peer_restores += 1
                log.info(
                    "event=peer_copy_used task=%s holder=%s step=%s bytes=%s seconds=%s",
                    t,
                    holders[t],
                    a.get("step"),
                    a.get("bytes"),
                    a.get("seconds"),
                )
            else:
                log.warning(
                    "event=peer_copy_not_used task=%s holder=%s status=%s reason=%r: the durable log serves",
                    t,
                    holders[t],
                    a.get("status"),
                    a.get("message"),
                )
        return pulled if len(pulled) == len(holders) else {}

    def take(self, tasks: Sequence[str], checkpoint: str, token: str, base: bool) -> None:
        answers = self._fan_out(
            "/shards/take", {t: {"checkpoint": checkpoint, "token": token, "base": base} for t in tasks}
        )
        bad = {t: a for t, a in answers.items() if a.get("status") != "ok"}
        if bad:
            self.finish(tasks, checkpoint, committed=False)
            raise ShardError(f"the PS agents do not all hold state {token}: {bad}")

    def write(
        self, tasks: Sequence[str], checkpoint: str, dedup_against: str | None
    ) -> dict[str, list[dict[str, Any]]]:
        answers = self._fan_out(
            "/shards/write", {t: {"checkpoint": checkpoint, "dedup_against": dedup_against} for t in tasks}
        )
        parts: dict[str, list[dict[str, Any]]] = {}
        for a in answers.values():
            for name, entries in (a.get("parts") or {}).items():
                parts.setdefault(name, []).extend(entries)
        for entries in parts.values():
            entries.sort(key=lambda e: int(e.get("offset", 0)))
        return parts

    def load(self, shards: Mapping[str, Sequence[ShardKey]], checkpoint: str, *, durable: bool) -> None:
        """Every PS agent reads its rows of ``checkpoint`` into its tier; raises when one cannot."""
        answers = self._fan_out(
            "/shards/load",
            {
                task: {
                    "checkpoint": checkpoint,
                    "shards": [[k.name, k.offset, k.rows] for k in keys],
                    "durable": durable,
                }
                for task, keys in shards.items()
            },
        )
        bad = {t: a for t, a in answers.items() if a.get("status") != "ok"}
        if bad:
            raise ShardError(f"loading {checkpoint} on the PS agents failed: {bad}")
        self.active = tuple(sorted(shards))

    def finish(self, tasks: Sequence[str], checkpoint: str, *, committed: bool) -> None:
        with contextlib.suppress(ShardError):
            self._fan_out("/shards/finish", {t: {"checkpoint": checkpoint, "committed": committed} for t in tasks})
