"""``psguard ls | verify | gc | compact | inspect | copy``: look after a durable checkpoint log by hand."""

from __future__ import annotations

import argparse
import datetime as dt
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from psguard.errors import ConfigError, NoCheckpointError
from psguard.progress import Progress, human_bytes, open_progress
from psguard.storage.metered import MeteredBackend
from psguard.storage.registry import split_url
from psguard.store.copy import copy_checkpoint
from psguard.store.facade import Store
from psguard.store.index import CheckpointInfo
from psguard.store.verify import VerifyReport


def parse_storage_options(pairs: Sequence[str] | None) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; values are JSON when they parse as JSON (numbers, booleans, objects)."""
    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--storage-option takes KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def add_store_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="store URL: a path, file://, memory://, s3://bucket/prefix, hdfs://host:port/path")
    p.add_argument(
        "--storage-option",
        "-o",
        action="append",
        metavar="KEY=VALUE",
        help="passed to the storage client (e.g. endpoint_url=http://127.0.0.1:8333); repeatable",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


def require_output_folder(path: str | Path, what: str) -> Path:
    """Refuse an output folder that can never be made because it, or a folder above it, is a file: a bad argument
    (exit 2) said before any work, not an ``ENOTDIR`` traceback after it."""
    p = Path(path).expanduser().absolute()
    for candidate in (p, *p.parents):
        if candidate.exists():
            if not candidate.is_dir():
                raise ConfigError(f"{what} {path}: {candidate} is a file, not a folder")
            break
    return p


def require_output_store(url: str, what: str) -> None:
    """:func:`require_output_folder` for a local store URL a command writes to; other schemes have no folders."""
    scheme, rest = split_url(url)
    if scheme == "file":
        require_output_folder(rest, what)


def open_store(args: argparse.Namespace, *, must_exist: bool = True) -> Store:
    """The store a command names. With ``must_exist`` (every command but ``follow``) a local store's folder must
    exist: the read-only and maintenance commands would otherwise report "no checkpoints" (and ``verify`` pass) for
    a typo. Other schemes have no folders to check (an S3 prefix exists once something is written under it)."""
    scheme, rest = split_url(args.url)
    path = Path(rest).expanduser().absolute()
    if must_exist and scheme == "file" and not path.is_dir():
        why = "it is a file, not a folder" if path.exists() else "the folder does not exist"
        raise NoCheckpointError(f"no store at {path}: {why}; check the URL")
    return Store.open(args.url, parse_storage_options(args.storage_option))


def add_progress_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quiet",
        "-q",
        action="store_true",
        help="no progress on stderr (shown by default: a bar on a terminal, else a line every few seconds)",
    )


def metered_progress(args: argparse.Namespace, what: str, total: int, *stores: Store) -> Progress:
    """Progress of ``what`` (``total`` bytes to read), fed by every read from ``stores``' backends."""
    progress = open_progress(what, total, quiet=args.quiet)
    for store in stores:
        store.backend = MeteredBackend(store.backend, progress.update)
    return progress


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _emit(args: argparse.Namespace, doc: Any, text: Callable[[], str]) -> None:
    print(json.dumps(doc, indent=2) if args.json else text())


def cmd_ls(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        bad: list[dict[str, str]] = []
        infos = store.checkpoints(on_error=lambda cid, e: bad.append({"id": cid, "error": str(e)}))

    def table() -> str:
        if not infos and not bad:
            return f"no checkpoints in {args.url}"
        header = (
            f"{'STEP':>10}  {'KIND':5}  {'ID':21}  {'PARENT':21}  {'TENSORS':>7}  "
            f"{'LOGICAL':>10}  {'STORED':>10}  COMMITTED (UTC)"
        )
        rows = [
            f"{i.step:>10}  {i.kind:5}  {i.id:21}  {i.parent or '-':21}  {i.tensors:>7}  "
            f"{human_bytes(i.logical_bytes):>10}  {human_bytes(i.stored_bytes):>10}  {_when(i.committed_at)}"
            for i in infos
        ]
        return "\n".join([header, *rows, *(f"UNREADABLE {b['id']}: {b['error']}" for b in bad)])

    _emit(args, {"checkpoints": [i.to_json() for i in infos], "unreadable": bad}, table)
    return 3 if bad else 0


def _target(store: Store, args: argparse.Namespace) -> str:
    return store.resolve(step=args.step, checkpoint_id=args.id)


def _verdict(r: VerifyReport) -> str:
    status = "ok" if r.ok else "CORRUPT"
    lines = [f"{r.checkpoint}: {status} ({r.chunks_checked} chunks, {human_bytes(r.bytes_checked)} checked)"]
    lines.extend(f"  {p.message}" for p in r.problems)
    return "\n".join(lines)


def cmd_verify(args: argparse.Namespace) -> int:
    """Each checkpoint's verdict printed as soon as it is known (JSON: one document at the end); every chunk
    read once however many chains share it."""
    reports: list[VerifyReport] = []
    with open_store(args) as store:
        targets = [_target(store, args)] if (args.step is not None or args.id) else store.checkpoint_ids()
        if not targets:
            raise NoCheckpointError(f"no checkpoint to verify in {args.url}")
        with metered_progress(args, "verify", store.chain_bytes(targets), store) as progress:
            for report in store.verify_all(targets):
                reports.append(report)
                if not args.json:
                    progress.write(_verdict(report))
    ok = all(r.ok for r in reports)
    if args.json:
        print(json.dumps({"ok": ok, "reports": [r.to_json() for r in reports]}, indent=2))
    return 0 if ok else 3


def cmd_gc(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        report = store.gc(keep_last=args.keep_last, keep_every_hours=args.keep_every_hours, dry_run=args.dry_run)

    def text() -> str:
        verb = "would delete" if report.dry_run else "deleted"
        lines = [
            f"kept {len(report.kept)} checkpoint(s); {verb} {len(report.deleted_checkpoints)} checkpoint(s) "
            f"and {report.deleted_chunks} chunk(s)"
        ]
        if report.chunks_deferred:
            lines.append("chunk deletion deferred: a writer is active or a manifest is unreadable; run gc again later")
        if report.young_chunks:
            lines.append(f"left {report.young_chunks} unreferenced chunk(s) younger than a lock lease for a later gc")
        lines.extend(f"  deleted {cid}" for cid in report.deleted_checkpoints)
        lines.extend(f"CORRUPT {p.checkpoint} (not counted as kept): {p.message}" for p in report.corrupt)
        return "\n".join(lines)

    _emit(args, report.to_json(), text)
    return 3 if report.corrupt else 0


def cmd_compact(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        target = _target(store, args)
        with metered_progress(args, "compact", store.chain_bytes([target]), store):
            info = store.compact(target)
    _emit(
        args,
        {"source": target, "compacted": info.to_json() if info else None},
        lambda: (
            f"{target} is already a full checkpoint"
            if info is None
            else f"compacted {target} into full checkpoint {info.id} "
            f"(step {info.step}, {human_bytes(info.stored_bytes)} written)"
        ),
    )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        cid = _target(store, args)
        m = store.manifest(cid)
        info = CheckpointInfo.of(m)
    tensors: dict[str, dict[str, Any]] = {
        name: {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "encoding": t.encoding,
            "chunks": len(t.refs()),
            "rows_changed": sum(s.count for s in t.segments) if t.segments else None,
        }
        for name, t in m.tensors.items()
    }
    for name, t in m.tensors.items():
        if t.encoding == "sharded":  # format version 2: each PS's part, as its agent wrote it
            tensors[name]["parts"] = [
                {
                    "offset": p.offset,
                    "rows": p.rows,
                    "encoding": p.encoding,
                    "bytes": sum(r.size for r in p.refs()),
                    "rows_changed": sum(s.count for s in p.segments) if p.encoding == "rows" else None,
                }
                for p in t.parts
            ]

    def text() -> str:
        lines = [
            f"checkpoint {m.id}  step {m.step}  {m.kind}"
            + (f" over {m.parent}" if m.parent else "")
            + f"  (format version {m.format_version})",
            f"metadata: {json.dumps(dict(m.metadata))}",
        ]
        width = max((len(n) for n in tensors), default=4)
        for name, t in tensors.items():
            extra = f"  {t['rows_changed']} rows changed" if t["rows_changed"] is not None else ""
            extra += f"  {len(t['parts'])} parts" if "parts" in t else ""
            lines.append(f"  {name:{width}}  {t['dtype']:9} {t['shape']!s:18} {t['encoding']}{extra}")
            for p in t.get("parts", ()):
                changed = f"  {p['rows_changed']} rows changed" if p["rows_changed"] is not None else ""
                lines.append(
                    f"  {'':{width}}    part rows [{p['offset']}, {p['offset'] + p['rows']})  {p['encoding']:4}  "
                    f"{human_bytes(p['bytes'])}{changed}"
                )
        return "\n".join(lines)

    _emit(args, {**info.to_json(), "format_version": m.format_version, "tensors": tensors}, text)
    return 0


def cmd_copy(args: argparse.Namespace) -> int:
    """Copy one checkpoint and its chain to another store (any backend), verified at the destination."""
    require_output_store(args.dest, "DEST_URL")
    with open_store(args) as src, Store.open(args.dest, parse_storage_options(args.dest_option)) as dst:
        target = _target(src, args)
        # read at the source, then read back at the destination to verify it
        with metered_progress(args, "copy", 2 * src.chain_bytes([target]), src, dst):
            report = copy_checkpoint(src, dst, target)

    def text() -> str:
        v = report.verified
        return (
            f"{report.checkpoint}: copied to {args.dest} ({len(report.chain)} checkpoint(s) in its chain, "
            f"{report.manifests_copied} manifest(s) and {report.chunks_copied} chunk(s), "
            f"{human_bytes(report.bytes_copied)} written); verified there: {v.chunks_checked} chunks, "
            f"{human_bytes(v.bytes_checked)}"
        )

    _emit(args, report.to_json(), text)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parsers = {}
    for name, func, text, target, progress in (
        ("ls", cmd_ls, "list the checkpoints in a store", None, False),
        ("verify", cmd_verify, "read every chunk and check hashes (exit 3 on corruption)", False, True),
        ("gc", cmd_gc, "apply retention: delete old checkpoints and unreferenced chunks", None, False),
        ("compact", cmd_compact, "fold a delta chain into a new full checkpoint", False, True),
        ("copy", cmd_copy, "copy a checkpoint and its chain to another store, verified there", True, True),
        ("inspect", cmd_inspect, "show a checkpoint's tensors (names, dtypes, shapes)", False, False),
    ):
        parsers[name] = p = sub.add_parser(name, help=text)
        add_store_arguments(p)
        if target is not None:
            g = p.add_mutually_exclusive_group(required=target)
            g.add_argument("--step", type=int, help="the newest checkpoint of this step")
            g.add_argument("--id", help="a checkpoint id (as `psguard ls` shows it)")
        if progress:
            add_progress_argument(p)
        p.set_defaults(func=func)
    p = parsers["gc"]
    p.add_argument("--keep-last", type=int, help="keep the newest N checkpoints")
    p.add_argument("--keep-every-hours", type=float, help="also keep one checkpoint per H hours")
    p.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    p = parsers["copy"]
    p.add_argument("dest", metavar="DEST_URL", help="the store to copy into (any backend)")
    p.add_argument(
        "--dest-option", action="append", metavar="KEY=VALUE", help="storage option for DEST_URL; repeatable"
    )
