"""The PS-side shards' and the peer copies' wiring in an agent: their HTTP endpoints, the calls between PS agents,
and the chief's view of the copies. Here, at the agent's top, because it joins the HTTP server and the tiers'
shard keeper, which may not import each other."""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from psguard.agent.control.httpd import AgentHTTPServer, Pieces, Request, RequestError, Response
from psguard.agent.tiers.copy_settings import PeerCopyConfig
from psguard.errors import CorruptCheckpointError, PsguardError
from psguard.handoff.client import http_request

if TYPE_CHECKING:  # numpy, loaded with the shards (a worker's agent never keeps any)
    import numpy as np

    from psguard.agent.tiers.shard_client import ShardClient
    from psguard.agent.tiers.shards import ShardKeeper


def _json_handler(fn: Callable[[dict[str, Any]], dict[str, Any] | bytes | Pieces]) -> Callable[[Request], Response]:
    """An HTTP handler for a method that takes a JSON object and answers one (or a frame: bytes, pieces); bad
    input is a 400, a state that does not allow the call a 409."""

    def handle(request: Request) -> Response:
        body = request.json()
        if not isinstance(body, dict):
            raise RequestError(400, "the body must be a JSON object")
        try:
            return Response(200, fn(body))
        except CorruptCheckpointError as e:
            raise RequestError(400, str(e)) from None
        except PsguardError as e:
            raise RequestError(409, str(e)) from None

    return handle


def serve_shards(http: AgentHTTPServer, keeper: ShardKeeper, config: PeerCopyConfig) -> None:
    """A PS agent's ``POST /shards/<call>`` (the chief's agent's calls: apply, export, load, take, write,
    finish, pull) and its copies' endpoints: ``POST /peer-copy/put`` (an owner's frame, raw bytes),
    ``POST /peer-copy/read`` (a new agent's fetch, answered with a frame) and ``POST /peer-copy/stripe`` (this
    PS's own tier, for the holder of its group's parity). All need the ``control`` scope like every other POST:
    copy data is never open."""

    def put(request: Request) -> Response:
        try:
            return Response(200, keeper.holder.put(request.body))
        except CorruptCheckpointError as e:
            raise RequestError(400, str(e)) from None

    for name, handler in (
        ("apply", keeper.apply),
        ("export", keeper.export),
        ("load", keeper.load),
        ("take", keeper.take),
        ("write", keeper.write),
        ("finish", keeper.finish),
        ("pull", keeper.pull),
    ):
        http.add_post(f"/shards/{name}", _json_handler(handler))
    http.add_post("/peer-copy/put", put, binary_max=(max(config.chunk_mb, config.max_queue_mb) << 20) + (16 << 20))
    http.add_post("/peer-copy/read", _json_handler(keeper.holder.read))
    http.add_post("/peer-copy/stripe", _json_handler(keeper.stripe))


class PeerLink:
    """One PS agent's calls to another for the copies, with the credentials the job's agents share."""

    def __init__(self, token: str | None, tls: ssl.SSLContext | None) -> None:
        self._token = token
        self._tls = tls

    def send_frame(self, url: str, frame: bytes, timeout: float) -> dict[str, Any]:
        code, raw, _ = http_request(
            "POST",
            f"{url}/peer-copy/put",
            data=frame,
            content_type="application/octet-stream",
            token=self._token,
            timeout=timeout,
            tls=self._tls,
        )
        try:
            answer = json.loads(raw) if raw else None
        except ValueError:
            answer = None
        if code != 200 or not isinstance(answer, dict):
            detail = answer.get("error") if isinstance(answer, dict) else raw[:200].decode(errors="replace")
            raise PsguardError(f"POST {url}/peer-copy/put: HTTP {code}: {detail}")
        return answer

    def read_copy(self, url: str, body: Mapping[str, Any], timeout: float) -> tuple[dict[str, Any], list[np.ndarray]]:
        return self._read(f"{url}/peer-copy/read", body, timeout)

    def read_copy_into(
        self,
        url: str,
        body: Mapping[str, Any],
        timeout: float,
        out: np.ndarray,
        take: Callable[[int, np.ndarray], None] | None = None,
    ) -> dict[str, Any]:
        """:meth:`read_copy` with the answer's rows read straight into ``out`` (or handed to ``take`` piece by
        piece: :func:`~psguard.agent.tiers.copy_frames.read_frame_into`); the answer's header."""
        from psguard.agent.tiers.copy_frames import read_frame_into  # lazy: as in serve_shards

        header: dict[str, Any] = self._post(
            f"{url}/peer-copy/read", body, timeout, receive=lambda response: read_frame_into(response, out, take)
        )
        return header

    def read_stripe(self, url: str, body: Mapping[str, Any], timeout: float) -> tuple[dict[str, Any], list[np.ndarray]]:
        """A parity group member's tier (its agent's ``/peer-copy/stripe``), for the holder rebuilding another."""
        return self._read(f"{url}/peer-copy/stripe", body, timeout)

    def _read(self, url: str, body: Mapping[str, Any], timeout: float) -> tuple[dict[str, Any], list[np.ndarray]]:
        from psguard.agent.tiers.copy_frames import decode_frame  # lazy: as in serve_shards

        return decode_frame(self._post(url, body, timeout))

    def _post(
        self, url: str, body: Mapping[str, Any], timeout: float, receive: Callable[[Any], Any] | None = None
    ) -> Any:
        """POST ``body`` to ``url``: the frame it answers (its bytes, or what ``receive`` read of it as it came)."""
        code, answer, content_type = http_request(
            "POST",
            url,
            data=json.dumps(body).encode(),
            token=self._token,
            timeout=timeout,
            tls=self._tls,
            receive=receive,
        )
        if code != 200 or not content_type.startswith("application/octet-stream"):
            raise PsguardError(f"POST {url}: HTTP {code}: {answer[:200]!r}")
        return answer


def copies_status(client: ShardClient | None, memory_token: str | None = None) -> dict[str, Any] | None:
    """The chief's view of the peer copies (``/status``): each part's holder, the step its copy reached, and how
    many copies of the memory tier's newest state the part has (its own tier, plus the peer's when current)."""
    if client is None or client.copies == "none":
        return None
    parts: dict[str, dict[str, Any]] = {}
    tasks = client.active or tuple(client.copy_state)
    held = client.holders_of(tasks, memory_token) if memory_token is not None else None
    for task in tasks:
        state = dict(client.copy_state.get(task) or {})
        current = held is not None and held.get(task) is not None  # parity: every member of its group is current
        parts[task] = {**state, "current": current, "copies": 2 if current else 1}
    return {
        "mode": client.copies,
        "placement": client.copy_targets(),
        **({"parity_groups": [",".join(g) for g in client.parity_groups()]} if client.copies == "parity" else {}),
        "parts": parts,
        "peer_restores": client.peer_restores,
        "last_restore_sources": dict(client.last_restore_sources),
    }
