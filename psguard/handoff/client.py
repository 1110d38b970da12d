"""The HTTP calls a trainer makes to its agent: report a failure or a recovery, restart the PS servers.

They live in the contract, not in the agent's package, so a trainer never loads the daemon (HTTP server,
prober, supervisor, metrics) to make three requests. Each reads the agent's URL and token file from the
environment the agent set for its task (:mod:`psguard.handoff.contract`).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import ssl
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

from psguard.errors import ConfigError, PsguardError
from psguard.handoff.contract import ENV_AGENT_TOKEN_FILE, ENV_AGENT_URL
from psguard.handoff.credentials import read_secret_file
from psguard.handoff.tls import client_context, client_context_from_env

log = logging.getLogger(__name__)


def http_json(
    method: str,
    url: str,
    *,
    body: Mapping[str, Any] | None = None,
    token: str | None = None,
    timeout: float = 10.0,
    tls: ssl.SSLContext | None = None,
) -> tuple[int, Any]:
    """One request to an agent: ``(status, JSON body or None)``; ``OSError`` when it cannot connect or TLS fails.
    ``https://`` URLs verify the agent with ``tls``, else the environment's context, else the system store."""
    data = json.dumps(body or {}).encode() if method == "POST" else None
    status, raw, _ = http_request(method, url, data=data, token=token, timeout=timeout, tls=tls)
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, None


def http_request(
    method: str,
    url: str,
    *,
    data: bytes | None = None,
    content_type: str = "application/json",
    token: str | None = None,
    timeout: float = 10.0,
    tls: ssl.SSLContext | None = None,
    receive: Callable[[http.client.HTTPResponse], Any] | None = None,
) -> tuple[int, Any, str]:
    """One request to an agent with a raw body: ``(status, body, content type)``; as :func:`http_json`
    otherwise (the peer copies send and fetch bytes with it). With ``receive``, a 200 answer of raw bytes
    (``application/octet-stream``) is read by ``receive`` from the response as it arrives (a peer copy's rows go
    straight where they are kept, with no buffer of the whole body first), and its result is the body."""
    parts = urllib.parse.urlsplit(url)
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        context = tls or client_context_from_env() or client_context()
        conn = http.client.HTTPSConnection(parts.hostname or "", parts.port, timeout=timeout, context=context)
    else:
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    headers = {"Content-Type": content_type} if method == "POST" else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request(method, parts.path or "/", body=data, headers=headers)
        response = conn.getresponse()
        answer_type = response.getheader("Content-Type") or ""
        if receive is not None and response.status == 200 and answer_type.startswith("application/octet-stream"):
            out = receive(response)
        else:
            out = response.read()
    except http.client.HTTPException as e:
        raise OSError(f"{method} {url}: {e}") from e
    finally:
        conn.close()
    return response.status, out, answer_type


def read_token(path: str | None) -> str | None:
    """The bearer token in ``path`` (``None`` for no path); refused when others can read the file."""
    return None if path is None else read_secret_file(path, "--token-file")


def restart_ps_servers(
    url: str | None = None,
    *,
    reason: str = "in-process rejoin after a PS failure",
    failed_at: float | None = None,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """From the trainer: ask the chief's agent to restart every PS server and wait until they all serve (the
    ``restart_ps`` of :func:`psguard.trainer.recovery.run_with_recovery` under ``psguard agent``).

    ``url`` defaults to ``$PSGUARD_AGENT_URL`` (the token to the file ``$PSGUARD_AGENT_TOKEN_FILE`` names).
    ``failed_at`` (``time.time()``): a moment the failed generation still ran, e.g. its last step; a PS started since
    holds none of its state and is not restarted again. Returns the agent's outcome per PS agent;
    :class:`PsguardError` when one did not come back."""
    base = url or os.environ.get(ENV_AGENT_URL)
    if not base:
        raise ConfigError("no agent URL: run the trainer under `psguard agent`, which sets PSGUARD_AGENT_URL")
    body = {"reason": reason, "failed_at": failed_at}
    try:
        status, doc = _post(base, "/new-generation", body, timeout)
    except OSError as e:
        raise PsguardError(f"cannot reach the chief's agent at {base} to restart the PS servers: {e}") from e
    if status != 200 or not isinstance(doc, dict):
        detail = doc.get("peers") or doc.get("error") if isinstance(doc, dict) else doc
        raise PsguardError(f"the chief's agent at {base} could not restart every PS server (HTTP {status}): {detail}")
    return doc


def report_failure(
    failed_at: float | None = None, url: str | None = None, *, step: int | None = None, timeout: float = 5.0
) -> bool:
    """From the trainer, before it exits 75 after a PS failure: tell the chief's agent when it failed
    (``failed_at`` as for :func:`restart_ps_servers`; default now) and the last ``step`` trained, so that no PS
    started since is restarted again and the next restore can be counted in lost steps. Best effort: False when there
    is no agent to tell."""
    body: dict[str, Any] = {"failed_at": time.time() if failed_at is None else failed_at}
    if step is not None:
        body["step"] = int(step)
    return _tell_agent("/failure", body, url, timeout)


def report_recovery(
    restored_step: int,
    *,
    seen_step: int | None = None,
    source: str | None = None,
    shards_mapped: tuple[int, int] | None = None,
    url: str | None = None,
    timeout: float = 5.0,
) -> bool:
    """From the trainer after a restore: the agent turns it into lost steps (``psguard_lost_steps_total``).
    ``seen_step``: the highest step this process trained before (an in-process rejoin); ``shards_mapped``: how many
    of the shard files the PS nodes loaded were mapped, of how many (shown in ``/status``). Best effort."""
    body: dict[str, Any] = {"restored_step": int(restored_step), "seen_step": seen_step, "source": source}
    if shards_mapped is not None:
        body["shards_mapped"] = [int(shards_mapped[0]), int(shards_mapped[1])]
    return _tell_agent("/recovery", body, url, timeout)


def _post(base: str, path: str, body: dict[str, Any], timeout: float) -> tuple[int, Any]:
    token = read_token(os.environ.get(ENV_AGENT_TOKEN_FILE))
    return http_json("POST", f"{base.rstrip('/')}{path}", body=body, token=token, timeout=timeout)


def _tell_agent(path: str, body: dict[str, Any], url: str | None, timeout: float) -> bool:
    base = url or os.environ.get(ENV_AGENT_URL)
    if not base:
        return False
    try:
        code, _ = _post(base, path, body, timeout)
    except (OSError, ConfigError) as e:
        log.warning("could not tell the agent at %s (%s): %s", base, path, e)
        return False
    return code == 200
