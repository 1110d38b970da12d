"""``psguard bench store``: the durable log against the raw client and plain numpy, in one run.

Keys (see BENCHMARKS.md for targets and recorded results):

- ``persist_vs_raw_ratio``: throughput of ``Store.save`` of a full checkpoint to SeaweedFS over a raw s3fs
  ``pipe_file`` of the same bytes to the same server.
- ``delta_bytes_fraction``: stored bytes of a delta after 1% of a 2,000,000 x 32 float32 table changed, over
  the full checkpoint's stored bytes.
- ``restore_vs_numpy_ratio``: restore throughput from a local-folder store over ``np.load`` of the same
  tensors from plain ``.npy`` files (both from the page cache).
- ``peak_rss_ratio``: peak RSS growth while writing then restoring the checkpoint, over its size (measured in
  a fresh subprocess with the kernel's peak-RSS mark reset after the data exists).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from psguard.benchmarks.common import alternate, median, print_results, progress, reset_peak_rss, rss_bytes, timed
from psguard.storage.registry import redact
from psguard.store import Store
from psguard.tensors import Rows

MiB = 1 << 20


def make_tensors(total_bytes: int, seed: int) -> dict[str, np.ndarray]:
    """A recommendation-model-like checkpoint: one big table, a second table, dense layers."""
    rng = np.random.default_rng(seed)
    rows = total_bytes * 3 // 4 // (32 * 4)
    out: dict[str, np.ndarray] = {
        "emb/user": np.empty((rows, 32), np.float32),
        "emb/item": np.empty((total_bytes // 4 // (16 * 4) - 64, 16), np.float32),
        "dense/w": np.empty((1024, 256), np.float32),
        "step": np.array(12345, np.int64),
    }
    for v in out.values():
        if v.ndim == 2:
            rng.standard_normal(dtype=np.float32, out=v)  # in place: no temporary copy
    return out


def nbytes(tensors: dict[str, np.ndarray]) -> int:
    return sum(v.nbytes for v in tensors.values())


def bench_persist(server: Any, tensors: dict[str, np.ndarray], runs: int) -> dict[str, float]:
    import s3fs

    blob = b"".join(np.ascontiguousarray(v).tobytes() for v in tensors.values())
    size = len(blob)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    run_id = uuid.uuid4().hex[:8]

    def psguard_save(i: int) -> float:
        with Store.open(server.url(f"bench-{run_id}-{i}"), server.storage_options) as store:
            # fresh prefix: nothing to deduplicate against, every byte goes over the wire
            return timed(lambda: store.save(1, tensors))

    def raw_put(i: int) -> float:
        return timed(lambda: fs.pipe_file(f"{server.bucket}/raw-{run_id}-{i}", blob))

    ours, raw = alternate(runs, psguard_save, raw_put)
    progress(f"persist {size / MiB:.0f} MiB: psguard {median(ours):.2f}s, raw s3fs put {median(raw):.2f}s")
    return {
        "persist_vs_raw_ratio": median(raw) / median(ours),
        "persist_psguard_mib_s": size / MiB / median(ours),
        "persist_raw_mib_s": size / MiB / median(raw),
    }


def bench_delta(workdir: Path) -> dict[str, float]:
    rng = np.random.default_rng(7)
    table = rng.standard_normal((2_000_000, 32), dtype=np.float32)
    with Store.open(str(workdir / "delta")) as store:
        full = store.save(0, {"table": table})
        ids = np.sort(rng.choice(table.shape[0], size=table.shape[0] // 100, replace=False))
        table[ids] += 1.0
        delta = store.save(1, {"table": Rows(ids, table[ids], table.shape)}, parent=full.id)
    fraction = delta.stored_bytes / full.stored_bytes
    progress(f"delta after 1% rows changed: {delta.stored_bytes / MiB:.2f} MiB of {full.stored_bytes / MiB:.0f} MiB")
    return {"delta_bytes_fraction": fraction, "delta_bytes": delta.stored_bytes, "full_bytes": full.stored_bytes}


def bench_restore(workdir: Path, tensors: dict[str, np.ndarray], runs: int) -> dict[str, float]:
    size = nbytes(tensors)
    store_dir = workdir / "restore-store"
    npy_dir = workdir / "npy"
    npy_dir.mkdir()
    with Store.open(str(store_dir)) as store:
        cid = store.save(1, tensors).id
    for i, v in enumerate(tensors.values()):
        np.save(npy_dir / f"{i}.npy", v)

    def ours(_: int) -> float:
        with Store.open(str(store_dir)) as s:
            return timed(lambda: s.load(cid))

    def numpy_read(_: int) -> float:
        return timed(lambda: [np.load(p) for p in sorted(npy_dir.glob("*.npy"))])

    ours(0), numpy_read(0)  # warm the page cache for both
    a, b = alternate(runs, ours, numpy_read)
    progress(f"restore {size / MiB:.0f} MiB: psguard {median(a):.2f}s, numpy {median(b):.2f}s")
    return {
        "restore_vs_numpy_ratio": median(b) / median(a),
        "restore_psguard_mib_s": size / MiB / median(a),
        "restore_numpy_mib_s": size / MiB / median(b),
    }


def rss_child(url: str, size_mib: int) -> None:
    """Runs in a fresh process: the data exists, the peak mark is reset, then save + load.

    The storage options (they hold the S3 secret key) arrive as JSON on stdin: a command line is readable by
    every local user (``ps``, ``/proc/PID/cmdline``).
    """
    options = json.loads(sys.stdin.read() or "{}")
    tensors = make_tensors(size_mib * MiB, seed=3)
    size = nbytes(tensors)
    with Store.open(url, options) as store:
        store.checkpoint_ids()  # client libraries imported and connected: fixed costs, not growth
        base = rss_bytes()
        reset_peak_rss()
        cid = store.save(1, tensors).id
        restored = store.load(cid)
        peak = rss_bytes("VmHWM")
    assert all(np.array_equal(restored[k], tensors[k]) for k in tensors)
    print(json.dumps({"peak_growth": peak - base, "size": size}))


_RSS_CHILD = "import sys; from psguard.benchmarks.store import rss_child; rss_child(sys.argv[1], int(sys.argv[2]))"


def rss_child_command(url: str, size_mib: int) -> list[str]:
    """The child's command line: the URL (its credentials removed) and the size; never the storage options."""
    return [sys.executable, "-c", _RSS_CHILD, redact(url), str(size_mib)]


def bench_rss(server: Any, size_mib: int) -> dict[str, float]:
    url = server.url(f"rss-{uuid.uuid4().hex[:8]}")
    out = subprocess.run(
        rss_child_command(url, size_mib),
        input=json.dumps(server.storage_options),  # the secret key goes through a pipe, not argv
        check=True,
        capture_output=True,
        text=True,
    )
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    ratio = doc["peak_growth"] / doc["size"]
    progress(f"peak RSS growth writing+restoring {doc['size'] / MiB:.0f} MiB: {doc['peak_growth'] / MiB:.0f} MiB")
    return {"peak_rss_ratio": ratio, "peak_rss_growth_bytes": doc["peak_growth"]}


def run(size_mib: int = 512, runs: int = 3) -> dict[str, float]:
    from psguard.testbed.s3 import SeaweedS3

    workdir = Path(tempfile.mkdtemp(prefix="psguard-bench-"))
    results: dict[str, float] = {"size_mib": size_mib, "runs": runs}
    try:
        progress(f"starting SeaweedFS; checkpoint of {size_mib} MiB, {runs} runs per side")
        with SeaweedS3(data_dir=workdir / "seaweed") as server:
            tensors = make_tensors(size_mib * MiB, seed=1)
            results.update(bench_persist(server, tensors, runs))
            results.update(bench_restore(workdir, tensors, runs))
            del tensors
            results.update(bench_rss(server, size_mib))
        results.update(bench_delta(workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def cmd(args: argparse.Namespace) -> int:
    results = run(size_mib=args.size_mib, runs=args.runs)
    print_results(results, as_json=args.json)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("store", help="durable log vs raw s3fs and numpy (starts its own SeaweedFS)")
    p.add_argument("--size-mib", type=int, default=512, help="size of the full checkpoint (default 512)")
    p.add_argument("--runs", type=int, default=3, help="timed runs per side (default 3)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd)
