"""The owner's side of a peer copy (:mod:`.peer_copy` says why): :class:`CopySender` pushes the tier's state to its
holder (whole, then by deltas, in the background); :func:`fetch_copy` gets it back, verified, for a new agent."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from psguard.agent.tiers.copy_frames import MASK, copy_header, digests_from, encode_frame, rows_digest
from psguard.agent.tiers.copy_settings import PeerCopyConfig
from psguard.agent.tiers.memory_tier import StreamSnapshot
from psguard.codec.dtypes import dtype_from_name
from psguard.errors import CorruptCheckpointError, PsguardError
from psguard.tensors import Rows, TensorUpdate

#: A holder's answer read as it arrives (url, body, timeout, the rows' array, ``take(row, rows)`` called with each
#: piece): :meth:`psguard.agent.copies.PeerLink.read_copy_into`. Returns the answer's header.
ReadInto = Callable[[str, Mapping[str, Any], float, np.ndarray, Callable[[int, np.ndarray], None]], dict[str, Any]]

#: Makes an array the fetched rows go into (None: the fetch allocates anonymous memory).
Alloc = Callable[[tuple[int, ...], np.dtype[Any]], np.ndarray | None]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------- sender
@dataclass
class Delta:
    """A capture's change as the copy takes it: its rows and the digests after it."""

    step: int
    token: str
    parent: str
    updates: Mapping[str, TensorUpdate]
    digests: Mapping[str, int]

    @property
    def nbytes(self) -> int:
        return sum(u.values.nbytes + u.ids.nbytes for u in self.updates.values() if isinstance(u, Rows))


def _same_copy(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two frames' extra fields describe the same copy: equal but for the parity group's URLs (a member's
    new address must not make the survivors send their whole: that would reset the group)."""

    def bare(x: Mapping[str, Any]) -> dict[str, Any]:
        p = x.get("parity")
        return {**x, "parity": {k: v for k, v in p.items() if k != "urls"}} if isinstance(p, Mapping) else dict(x)

    return bare(a) == bare(b)


class CopySender:
    """The owner's side: pushes its tier's state to the holder the chief named, in the background. ``snapshot``:
    ``(view, layout, digests)`` of the tier at one state; ``post``: sends one frame, returns the answer's JSON."""

    def __init__(
        self,
        task: str,
        snapshot: Callable[[], tuple[StreamSnapshot, list[dict[str, Any]], dict[str, int]]],
        post: Callable[[str, bytes, float], dict[str, Any]],
        config: PeerCopyConfig,
    ) -> None:
        self.task = task
        self._snapshot = snapshot
        self._post = post
        self.config = config
        self._cond = threading.Condition()
        self._queue: deque[Delta] = deque()
        self._queued_bytes = 0
        self._target: tuple[str, str] | None = None  # (holder task, URL)
        self._extra: dict[str, Any] = {}  # fields every frame's header carries (``parity``: the owner's group)
        self._whole = True  # the next send is the whole state
        self._stop = False
        self._synced: tuple[int, str] | None = None  # (step, token) the holder acknowledged last
        self._known: tuple[str, int, str] | None = None  # a holder's URL and the (step, token) it holds: synced_with
        self._tier_step: int | None = None
        self._counts = {"whole": 0, "deltas": 0, "errors": 0, "dropped": 0, "bytes": 0}
        self._last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"psguard-copy-{task}", daemon=True)
        self._thread.start()

    def set_target(self, target: tuple[str, str] | None, extra: Mapping[str, Any] | None = None) -> None:
        """The holder the chief names (``None``: no copy) and what every frame to it carries (``extra``); a new
        one gets the whole state first."""
        with self._cond:
            if target == self._target and _same_copy(dict(extra or {}), self._extra):
                self._extra = dict(extra or {})  # a member's new address, carried by the next frames
                return
            self._target = target
            self._extra = dict(extra or {})
            self._restart(whole=True)
            self._synced = None
            known, self._known = self._known, None
            if known is not None and target is not None and target[1] == known[0]:
                self._whole, self._synced = False, known[1:]
            self._cond.notify_all()

    def synced_with(self, url: str, step: int, token: str) -> None:
        """The holder at ``url`` holds this owner's state ``(step, token)`` (a new agent just fetched its tier from
        it): if the chief names it next, deltas follow at once instead of a whole copy (or a parity reset)."""
        with self._cond:
            self._known = (url, step, token)

    def offer(self, delta: Delta | None, step: int) -> None:
        """After the owner's tier applied a capture: queue its delta (``None``: a whole capture, so the next
        send is whole). Never blocks on the network."""
        with self._cond:
            self._tier_step = step
            if self._target is None:
                return
            if delta is None:
                self._restart(whole=True)
            elif not self._whole:
                if self._queued_bytes + delta.nbytes > self.config.max_queue_mb << 20:
                    self._counts["dropped"] += len(self._queue) + 1
                    self._restart(whole=True)  # the holder lags too far: it gets the whole state next
                else:
                    self._queue.append(delta)
                    self._queued_bytes += delta.nbytes
            self._cond.notify_all()

    def wait_synced(self, token: str, timeout: float) -> bool:
        """Wait until the holder holds state ``token``; False when there is none, or after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._synced is not None and self._synced[1] == token:
                    return True
                left = deadline - time.monotonic()
                if self._target is None or self._stop or left <= 0:
                    return False
                self._cond.wait(left)

    def status(self) -> dict[str, Any]:
        with self._cond:
            synced, now = self._synced, self._tier_step
            lag = None if synced is None or now is None else max(0, now - synced[0])
            return {
                "target": self._target[0] if self._target else None,
                "synced_step": synced[0] if synced else None,
                "synced_token": synced[1] if synced else None,
                "lag_steps": lag,
                "queued": len(self._queue),
                "sending_whole": self._whole and self._target is not None,
                **self._counts,
                "last_error": self._last_error,
            }

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (self._target is None or (not self._whole and not self._queue)):
                    self._cond.wait()
                if self._stop:
                    return
                target = self._target
                delta = None if self._whole else self._queue.popleft()
                if delta is not None:
                    self._queued_bytes -= delta.nbytes
            assert target is not None
            try:
                answer = self._send_whole(target) if delta is None else self._send_delta(target, delta)
                if answer is not None:
                    with self._cond:
                        self._counts["whole" if delta is None else "deltas"] += 1
                        self._synced = (int(answer["step"]), str(answer["token"]))
                        self._cond.notify_all()
            except Exception as e:  # the holder is down or refused: report, wait, start again whole
                with self._cond:
                    self._counts["errors"] += 1
                    self._last_error = f"{type(e).__name__}: {e}"
                    if self._target == target:
                        self._restart(whole=True)
                log.warning("event=peer_copy_failed owner=%s holder=%s error=%r", self.task, target[0], str(e))
                with self._cond:
                    self._cond.wait(self.config.retry_after)

    def _pace(self, nbytes: int, started: float) -> None:
        rate = self.config.max_mb_per_s
        if rate > 0:
            wait = nbytes / (rate * (1 << 20)) - (time.perf_counter() - started)
            if wait > 0:
                with self._cond:
                    self._cond.wait(wait)

    def _answer(self, target: tuple[str, str], frame: bytes) -> dict[str, Any]:
        t0 = time.perf_counter()
        answer = self._post(target[1], frame, self.config.request_timeout)
        self._pace(len(frame), t0)
        with self._cond:
            self._counts["bytes"] += len(frame)
        status = answer.get("status")
        if status != "ok":
            raise PsguardError(f"{target[0]} answered {status}: {answer.get('message', '')}")
        return answer

    def begin_whole(self) -> None:
        """Called by ``snapshot`` under the owner's lock: the snapshot holds every delta queued so far, and the
        deltas applied after it are queued on top of it (``offer`` runs under the same lock)."""
        with self._cond:
            self._restart(whole=False)

    def _restart(self, *, whole: bool) -> None:
        """Drop the queued deltas; the next send is the whole state, or the deltas queued from now on."""
        self._queue.clear()
        self._queued_bytes = 0
        self._whole = whole

    def _send_whole(self, target: tuple[str, str]) -> dict[str, Any] | None:
        """The whole state, in a session of frames; the holder's last answer (None: nothing to copy yet)."""
        snap, layout, digests = self._snapshot()
        with snap:
            if snap.token is None:
                with self._cond:
                    self._whole = True
                    self._cond.wait(self.config.retry_after)
                return None
            base = {**self._extra, "task": self.task, "session": secrets.token_hex(8)}
            begin = copy_header(snap.step, snap.token, snap.metadata, layout, digests)
            self._answer(target, encode_frame({**base, "op": "begin", **begin}))
            chunk = max(1, self.config.chunk_mb) << 20
            for t in layout:
                stream = snap.tensors[t["name"]]
                n = stream.shape[0] if stream.shape else 1
                rows = max(1, chunk // max(1, stream.nbytes // max(1, n)))
                for start in range(0, n, rows):
                    head = {**base, "op": "fill", "name": t["name"], "start": start}
                    self._answer(target, encode_frame(head, [stream.read(start, min(n, start + rows))]))
            answer = self._answer(target, encode_frame({**base, "op": "end"}))
        log.info("event=peer_copy_whole_sent owner=%s holder=%s step=%s", self.task, target[0], answer["step"])
        return answer

    def _send_delta(self, target: tuple[str, str], d: Delta) -> dict[str, Any]:
        tensors: list[dict[str, Any]] = []
        arrays: list[np.ndarray] = []
        for name, u in d.updates.items():
            if isinstance(u, Rows):
                tensors.append({"name": name, "kind": "rows"})
                arrays += [np.asarray(u.ids, dtype=np.int64), u.values]
            else:
                tensors.append({"name": name, "kind": "same"})
        frame = encode_frame(
            {
                **self._extra,  # replaced, never changed: read without the lock
                "task": self.task,
                "op": "delta",
                "parent": d.parent,
                **copy_header(d.step, d.token, {}, tensors, d.digests),
            },
            arrays,
        )
        return self._answer(target, frame)


def fetch_copy(
    owner: str,
    holder_url: str,
    token: str,
    post: Callable[[str, Mapping[str, Any], float], tuple[dict[str, Any], list[np.ndarray]]],
    config: PeerCopyConfig,
    alloc: Alloc | None = None,
    read_into: ReadInto | None = None,
    write: Callable[[np.ndarray, int, np.ndarray], None] | None = None,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A new agent of ``owner`` takes its shards from the holder's copy, at ``token`` only, verified: the copy's
    description and arrays (made by ``alloc``: the tier's files). :class:`PsguardError` when the holder has no
    copy at ``token`` (or no room here), :class:`CorruptCheckpointError` when the bytes do not match the digests.
    ``read_into`` (``post`` with the rows handed over as they arrive) has them placed by ``write(array, row, rows)``.
    """
    timeout = config.request_timeout
    info, _ = post(holder_url, {"owner": owner, "token": token}, timeout)
    if info.get("status") == "refused":  # a parity holder's reconstruction that did not verify
        raise CorruptCheckpointError(f"the holder refused {owner}'s state: {info.get('message', '')}")
    if info.get("status") != "ok":
        raise PsguardError(f"the holder has no copy of {owner}: {info.get('status')} {info.get('message', '')}")
    if info.get("token") != token:
        raise PsguardError(f"the holder's copy of {owner} is at step {info.get('step')}, not at the chief's state")
    digests = digests_from(info.get("digests"))
    arrays: dict[str, np.ndarray] = {}
    ranges: list[tuple[str, int, int]] = []  # every request, in order: tensor, start, stop
    for t in info.get("tensors") or []:
        name, shape, dtype = str(t["name"]), tuple(int(x) for x in t["array_shape"]), dtype_from_name(str(t["dtype"]))
        made = alloc(shape, dtype) if alloc is not None else None
        arrays[name] = made if made is not None else np.empty(shape, dtype=dtype)
        rows = max(1, (max(1, config.chunk_mb) << 20) // max(1, arrays[name].nbytes // max(1, shape[0])))
        ranges += [(name, start, min(shape[0], start + rows)) for start in range(0, shape[0], rows)]

    def place(name: str, start: int, stop: int) -> int:
        """Fetch one chunk, check it and put it in place: its rows' digest (numpy and zlib release the GIL)."""
        out, total = arrays[name], 0

        def take(row: int, rows: np.ndarray) -> None:
            nonlocal total
            total = (total + rows_digest(rows, first=start + row)) & MASK
            try:
                if write is not None:
                    write(out, start + row, rows)
                else:
                    out[start + row : start + row + rows.shape[0]] = rows
            except OSError as e:  # no room on the node's tmpfs: the log is used instead
                raise PsguardError(f"no memory for {owner}'s copy on this node: {e}") from None

        body = {"owner": owner, "token": token, "name": name, "start": start, "stop": stop}
        if read_into is not None:
            answer = read_into(holder_url, body, timeout, out[start:stop], take)
        else:
            answer, got = post(holder_url, body, timeout)
            if answer.get("status") == "ok" and len(got) == 1:
                if got[0].shape != (stop - start, *out.shape[1:]) or got[0].dtype != out.dtype:
                    raise CorruptCheckpointError(f"the copy of {name} from the holder has the wrong shape or dtype")
                take(0, got[0])
        if answer.get("status") != "ok" or len(answer.get("arrays") or ()) != 1:
            raise PsguardError(f"the holder's copy of {owner} moved on while it was fetched: {answer}")
        return total

    sums = dict.fromkeys(arrays, 0)
    # ``fetch_streams`` requests in flight: each is fetched, checked and placed on its own thread.
    with ThreadPoolExecutor(max_workers=max(1, config.fetch_streams), thread_name_prefix="psguard-copy-fetch") as pool:
        for (name, _, _), digest in zip(ranges, pool.map(lambda r: place(*r), ranges), strict=True):
            sums[name] = (sums[name] + digest) & MASK
    bad = sorted(n for n, d in sums.items() if d != digests.get(n))
    if bad:
        raise CorruptCheckpointError(
            f"the peer copy of {owner} does not match its owner's digests in {bad[:3]}: refused"
        )
    return info, arrays
