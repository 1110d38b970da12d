"""Crash points, enumerated, per path and backend (:mod:`psguard.testbed.crash` says how)::

    .venv/bin/python -m psguard.testbed.crashpoints --backend local           # the process dies at each point
    .venv/bin/python -m psguard.testbed.crashpoints --backend local --lazyfs  # ... and the unsynced writes with it
    .venv/bin/python -m psguard.testbed.crashpoints --backend s3              # on a SeaweedFS started here
    .venv/bin/python -m psguard.testbed.crashpoints --backend tmpfs           # the spool and the tier files

``--backend s3 --s3-url s3://bucket/prefix`` uses that store instead (credentials and endpoint from the usual
``AWS_*`` variables). Prints each path's crash points and whether all passed, and the failing points with what
was wrong; ``--json FILE`` writes every call and verdict. Exits 1 when a point fails.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from psguard.testbed.crash import handoff_paths
from psguard.testbed.crash.runner import CrashPath, PathReport, Target, enumerate_path
from psguard.testbed.crash.session import Run
from psguard.testbed.crash.store_check import check_store
from psguard.testbed.crash.store_paths import STORE_PATHS

__all__ = ["paths", "main"]

#: The gc path's seed: its data makes the save after the gc write a chunk into a folder (chunks/f1/) that the gc
#: deleted one from, so that save's sync makes some of the gc's deletions durable before others.
GC_SEED = 13


def _store_roots(run: Run) -> list[Path]:
    return [run.store_root] if run.backend == "local" else []


def _check_store(run: Run, _: Any) -> list[str]:
    return check_store(run)


def paths(backend: str) -> list[CrashPath]:
    """The paths enumerated on ``backend``: the durable log's on a store, the hand-off's on tmpfs."""
    if backend == "tmpfs":
        return [
            CrashPath("spool-writer", handoff_paths.spool_writer, handoff_paths.check_spool_writer, _spool),
            CrashPath(
                "spool-agent",
                handoff_paths.spool_agent,
                handoff_paths.check_spool_agent,
                _spool,
                setup=handoff_paths.setup_spool_agent,
            ),
            CrashPath("tier-files", handoff_paths.tier_files, handoff_paths.check_tier_files, _parts),
        ]
    return [
        CrashPath(name, workload, _check_store, _store_roots, seed=GC_SEED if name == "gc" else 0)
        for name, workload in STORE_PATHS.items()
    ]


def _spool(run: Run) -> list[Path]:
    return [handoff_paths.spool_root(run)]


def _parts(run: Run) -> list[Path]:
    return [handoff_paths.part_folder(run)]


@contextlib.contextmanager
def _s3(url: str | None) -> Iterator[tuple[str, dict[str, Any]]]:
    """The S3 prefix and storage options: the one given (``AWS_*`` for the rest), or a SeaweedFS started here."""
    importlib.import_module("psguard.storage.s3")  # once here, not in every point's two children (0.3 s each)
    if url:
        endpoint = os.environ.get("AWS_ENDPOINT_URL")
        yield url, ({"endpoint_url": endpoint} if endpoint else {})
        return
    from psguard.testbed.s3 import SeaweedS3  # lazy: starts a server, only for an S3 run without a store given

    with SeaweedS3() as server:
        yield server.url("crashpoints"), dict(server.storage_options)


def _print(report: PathReport) -> None:
    verdict = "all pass" if report.passed else f"{len(report.failures)} FAIL"
    print(f"{report.path:<14} {report.backend:<14} {report.points:>5} crash points  {verdict}  ({report.seconds:.1f}s)")
    for failure in report.failures[:5]:
        print(f"    point {failure.point} (after {failure.call}):")
        for problem in failure.problems[:3]:
            print(f"        {problem}")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m psguard.testbed.crashpoints", description=__doc__.split("::")[0])
    parser.add_argument("--backend", choices=("local", "s3", "tmpfs"), required=True)
    parser.add_argument("--lazyfs", action="store_true", help="local: also drop every write no fsync made durable")
    parser.add_argument("--paths", help="comma-separated path names (default: every path of the backend)")
    parser.add_argument("--s3-url", help="s3: a prefix to use (default: start a SeaweedFS)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="points checked at once")
    parser.add_argument("--json", type=Path, help="write every path's calls and verdicts here")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders (printed at the end)")
    args = parser.parse_args(argv)
    if args.lazyfs and args.backend != "local":
        parser.error("--lazyfs applies to the local backend (S3 has no fsync; tmpfs loses everything in a power cut)")
    chosen = paths(args.backend)
    if args.paths:
        wanted = args.paths.split(",")
        unknown = sorted(set(wanted) - {p.name for p in chosen})
        if unknown:
            parser.error(f"unknown path(s) {unknown} for {args.backend}; known: {[p.name for p in chosen]}")
        chosen = [p for p in chosen if p.name in wanted]
    memory = Path("/dev/shm")  # the runs are throwaway: tmpfs spares the disk (the page-cache model needs none)
    workdir = Path(tempfile.mkdtemp(prefix="psguard-crashpoints-", dir=memory if memory.is_dir() else None))
    reports: list[PathReport] = []
    try:
        with contextlib.ExitStack() as stack:
            s3_url, options = stack.enter_context(_s3(args.s3_url)) if args.backend == "s3" else ("", {})
            target = Target(args.backend, workdir, lazyfs=args.lazyfs, s3_url=s3_url, options=options)
            for path in chosen:
                reports.append(enumerate_path(path, target, jobs=args.jobs))
                _print(reports[-1])
    finally:
        if args.json is not None:
            args.json.write_text(json.dumps({"reports": [r.to_json() for r in reports]}, indent=1))
        if args.keep:
            print(f"runs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    total = sum(r.points for r in reports)
    print(f"{total} crash points on {len(reports)} paths: {'all pass' if all(r.passed for r in reports) else 'FAILED'}")
    return 0 if all(r.passed for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
