"""``psguard demo``: the durable log at work on the embedded default store (a local folder, no server).

A sample recommendation-style model (two embedding tables, a dense layer, Adam-like slots) is trained with
sparse updates in numpy; every few steps an incremental checkpoint is written (a full base first, then
deltas of the rows that changed, a new base when the chain gets long), then the store is listed, verified,
and the newest checkpoint restored and compared bit for bit with the live model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np

from psguard.store import CheckpointInfo, Store
from psguard.tensors import Full, Rows, TensorUpdate


def say(msg: str) -> None:
    print(msg, flush=True)


class SampleModel:
    """Two embedding tables updated on the rows a batch touches, and dense weights updated every step."""

    def __init__(self, users: int, items: int, dim: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.tensors: dict[str, np.ndarray] = {
            "model/user_embedding": self.rng.standard_normal((users, dim), dtype=np.float32) * 0.05,
            "model/item_embedding": self.rng.standard_normal((items, dim), dtype=np.float32) * 0.05,
            "model/dense/kernel": self.rng.standard_normal((2 * dim, 1), dtype=np.float32),
            "optimizer/iterations": np.array(0, np.int64),
        }
        self.touched: dict[str, set[int]] = {"model/user_embedding": set(), "model/item_embedding": set()}

    def train_step(self, batch: int) -> None:
        for name in self.touched:
            table = self.tensors[name]
            ids = np.unique(self.rng.zipf(1.3, size=batch) % table.shape[0])
            table[ids] -= 0.01 * self.rng.standard_normal((len(ids), table.shape[1]), dtype=np.float32)
            self.touched[name].update(ids.tolist())
        self.tensors["model/dense/kernel"] *= np.float32(0.999)
        self.tensors["optimizer/iterations"] = self.tensors["optimizer/iterations"] + 1

    def capture(self, full: bool) -> dict[str, TensorUpdate]:
        out: dict[str, TensorUpdate] = {}
        for name, value in self.tensors.items():
            if name in self.touched and not full:
                ids = np.array(sorted(self.touched[name]), dtype=np.int64)
                out[name] = Rows(ids, value[ids].copy(), value.shape)
            else:
                out[name] = Full(value.copy())
        for touched in self.touched.values():
            touched.clear()
        return out


def run(directory: Path, steps: int, every: int, new_base_every: int, users: int) -> dict[str, object]:
    if directory.exists():
        shutil.rmtree(directory)
    store_dir = directory / "store"
    say(f"psguard demo: training a sample recommendation model, checkpointing to {store_dir}")
    model = SampleModel(users=users, items=users // 4, dim=32, seed=0)
    infos: list[CheckpointInfo] = []
    stalls: list[float] = []
    with Store.open(str(store_dir)) as store:
        parent: str | None = None
        for step in range(1, steps + 1):
            model.train_step(batch=2048)
            if step % every:
                continue
            full = parent is None or len(infos) % new_base_every == 0
            t0 = time.perf_counter()
            updates = model.capture(full)
            stalls.append(time.perf_counter() - t0)
            info = store.save(step, updates, parent=None if full else parent)
            parent = info.id
            infos.append(info)
            say(
                f"  step {step:5d}: {info.kind:5} checkpoint {info.id}  "
                f"{info.stored_bytes / 2**20:7.2f} MiB written of {info.logical_bytes / 2**20:.1f} MiB"
            )
        say("\n$ psguard ls " + str(store_dir))
        listing = store.checkpoints()
        for i in listing:
            say(f"  step {i.step:5d}  {i.kind:5}  {i.id}  parent={i.parent or '-'}")
        say("\nverifying every checkpoint (size, CRC32C and SHA-256 of every chunk)...")
        reports = [store.verify(i.id) for i in listing]
        for r in reports:
            say(f"  {r.checkpoint}: {'ok' if r.ok else 'CORRUPT'} ({r.chunks_checked} chunks)")
        restored = store.load_latest()
        identical = all(
            restored.tensors[k].tobytes() == np.asarray(v).tobytes() and restored.tensors[k].dtype == v.dtype
            for k, v in model.tensors.items()
        )
        say(f"\nrestored step {restored.info.step}: bit-identical to the live model: {identical}")
    full_bytes = sum(i.stored_bytes for i in infos if i.kind == "full")
    delta_bytes = sum(i.stored_bytes for i in infos if i.kind == "delta")
    deltas = sum(1 for i in infos if i.kind == "delta")
    summary: dict[str, object] = {
        "checkpoints": len(infos),
        "full": len(infos) - deltas,
        "deltas": deltas,
        "bytes_full": full_bytes,
        "bytes_deltas": delta_bytes,
        "mean_delta_fraction": (delta_bytes / deltas) / (full_bytes / (len(infos) - deltas)) if deltas else None,
        "verified": all(r.ok for r in reports),
        "restored_identical": identical,
        "mean_capture_seconds": float(np.mean(stalls)),
    }
    (directory / "report.json").write_text(json.dumps(summary, indent=2))
    say(f"\nsummary: {json.dumps(summary)}\nreport written to {directory / 'report.json'}")
    return summary


def cmd(args: argparse.Namespace) -> int:
    summary = run(Path(args.dir), args.steps, args.every, args.new_base_every, args.users)
    return 0 if summary["verified"] and summary["restored_identical"] else 1


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="write, list, verify and restore incremental checkpoints of a sample model")
    p.add_argument("--dir", default="psguard-demo", help="working folder (recreated; default ./psguard-demo)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    p.add_argument("--new-base-every", type=int, default=5, help="a full checkpoint every N checkpoints")
    p.add_argument("--users", type=int, default=200_000, help="rows of the user table")
    p.set_defaults(func=cmd)
