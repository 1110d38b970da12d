"""``psguard status URL... | --dir DIR [--token-file FILE] [--json]``: a running job at a glance, from its agents'
``/status`` (the chief's names its peers, which are asked too): a row per task, then the chief's tiers. The token
is sent, never printed. Exit 0 when every agent answered and is ready, 1 otherwise."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from psguard.errors import ConfigError
from psguard.handoff.client import http_json, read_token
from psguard.handoff.contract import ENV_AGENT_TOKEN_FILE


def collect(urls: list[str], token: str | None, timeout: float = 5.0) -> list[dict[str, Any]]:
    """Each agent's ``/status`` (or ``{"url": ..., "error": ...}``), following the chief's peers; in order."""
    out: list[dict[str, Any]] = []
    queue = [u.rstrip("/") for u in urls]
    seen: set[str] = set()
    while queue:
        url = queue.pop(0)
        if url in seen:
            continue
        seen.add(url)
        try:
            code, doc = http_json("GET", f"{url}/status", token=token, timeout=timeout)
        except OSError as e:
            out.append({"url": url, "error": f"unreachable: {e}"})
            continue
        if code == 401:
            hint = "a token is needed: --token-file FILE" if token is None else "the token was refused"
            out.append({"url": url, "error": f"HTTP 401 ({hint})"})
            continue
        if code != 200 or not isinstance(doc, dict):
            out.append({"url": url, "error": f"HTTP {code}"})
            continue
        out.append({"url": url, **doc})
        queue += [str(p["url"]).rstrip("/") for p in doc.get("peers") or [] if isinstance(p, dict) and p.get("url")]
    return out


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def format_status(agents: list[dict[str, Any]]) -> str:
    """The table of tasks, then each chief's tiers."""
    rows = [("TASK", "STATE", "PID", "RESTARTS", "HEALTH", "READY", "AGENT")]
    for a in agents:
        if "error" in a:
            rows.append(("?", a["error"], "", "", "", "no", a["url"]))
            continue
        ready = "yes" if a.get("ready") else "no"
        cells = [_cell(a.get(k)) for k in ("task", "state", "pid", "restarts", "health")]
        rows.append((*cells, ready, a["url"]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    for a in agents:
        if a.get("role") != "chief":
            continue
        lines.append("")
        lines.append(f"{a.get('task')}: store {_cell(a.get('store'))}, spool {_cell(a.get('spool'))}")
        memory_mb = a.get("memory_bytes")
        size = f" ({memory_mb / 2**20:.1f} MiB)" if isinstance(memory_mb, int | float) else ""
        lines.append(f"  memory tier   step {_cell(a.get('memory_step'))}{size}")
        lines.append(
            f"  durable log   step {_cell(a.get('durable_step'))} ({_cell(a.get('durable_checkpoint'))}), "
            f"lag {_cell(a.get('persist_lag_steps'))} steps"
        )
        p = a.get("persister") or {}
        if p:
            lines.append(
                f"  persister     {p.get('pending_requests', 0)} pending, {p.get('checkpoints_written', 0)} written, "
                f"{p.get('failures', 0)} failures, last error: {_cell(p.get('last_error'))}"
            )
        copies = (a.get("copies") or {}).get("parts") or {}
        if copies:
            cells = [
                f"{task} {part.get('copies', 1)}"
                + (f" (+{part['holder']})" if part.get("current") else f" (copy at {_cell(part.get('step'))})")
                for task, part in sorted(copies.items())
            ]
            lines.append(f"  copies        {', '.join(cells)}")
        generation = a.get("last_generation") or {}
        lines.append(
            f"  generation    {_cell(a.get('generation'))}"
            + (f", last: {json.dumps(generation.get('peers'))}" if generation.get("peers") else "")
            + (f", lost steps at the last recovery: {a['last_lost_steps']}" if a.get("last_lost_steps") else "")
        )
    return "\n".join(lines)


def run_status(args: argparse.Namespace) -> int:
    urls = list(args.urls or [])
    if args.dir:
        folder = Path(args.dir)
        found = [p.read_text().strip() for p in sorted(folder.glob("agents/*/url"))]
        if not found:
            raise ConfigError(f"{folder}: no agents/*/url files (is it a psguard wrap --dir or psguard demo folder?)")
        urls += found
    if not urls:
        raise ConfigError("give the agents' URLs (the chief's is enough) or --dir DIR of a psguard wrap or demo run")
    token = read_token(args.token_file or os.environ.get(ENV_AGENT_TOKEN_FILE))
    agents = collect(urls, token, timeout=args.timeout)
    print(json.dumps({"agents": agents}, indent=2, default=str) if args.json else format_status(agents))
    return 0 if all("error" not in a and a.get("ready") for a in agents) else 1


def register(sub: Any) -> None:
    p = sub.add_parser("status", help="a running job's tasks, tiers, newest checkpoints and restarts")
    p.add_argument(
        "urls", nargs="*", metavar="URL", help="agents' HTTP URLs (the chief's is enough: it names its peers)"
    )
    p.add_argument("--dir", help="a psguard wrap --dir or psguard demo folder: its agents/*/url")
    p.add_argument("--token-file", help=f"the agents' bearer token (default ${ENV_AGENT_TOKEN_FILE})")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per request (default 5)")
    p.add_argument("--json", action="store_true", help="print every agent's /status as JSON")
    p.set_defaults(func=run_status)
