"""The hand-off paths on tmpfs: the spool's two ends and a PS agent's tier files, each killed at every call.

A process crash, not a power cut: the spool and the tier folder live on tmpfs, which a power cut empties anyway,
so what must hold is what the other side and a successor see when one process dies at any point:

- ``spool-writer``: the trainer's end dies while handing off a whole capture and a delta. A successor agent
  applies every capture that was handed off (``submit`` returned), in order, and at most the one in flight;
  never a torn one (no capture answered with an error); the dead writer's half-written folder is removed, and
  the next writer's whole capture is applied.
- ``spool-agent``: the agent dies while applying two captures and answering a restore request, its trainer
  alive. Every answer it wrote reads whole; a restore folder, once under its final name, reads back and verifies
  as the state of the agent that wrote it; the successor answers every capture and the request (none twice with
  different answers to the trainer), and leaves no capture, temporary answer or half-exported restore behind.
- ``tier-files``: a PS agent keeping its tier in files dies while applying a capture, exporting it (the files
  linked into a restore folder), applying the next (the exported file copied first), exporting again and
  stopping. An acknowledged export's files read back and verify while no later export or stop was asked for;
  any restore folder under its final name reads back as one of the states; a successor starts on the folder and
  leaves nothing.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from psguard.agent.tiers.memory_tier import MemoryTier
from psguard.agent.tiers.shards import ShardKeeper
from psguard.agent.tiers.spool_server import SpoolServer
from psguard.errors import NoCheckpointError, PsguardError
from psguard.handoff.contract import Tier
from psguard.handoff.parts import ShardKey
from psguard.handoff.spool import AGENT_TMP, Capture, NeedFullCaptureError, SpoolPaths, read_restore
from psguard.handoff.tensor_bundle import bundle_files, read_bundle
from psguard.tensors import Full, Rows, TensorUpdate
from psguard.testbed.crash.session import Op, Run, Session, read_ops
from psguard.testbed.crash.store_check import same_arrays
from psguard.testbed.crash.store_paths import delta, state
from psguard.trainer.spool_writer import CaptureHandle, RestoreHandle, SpoolWriter

__all__ = ["spool_agent", "spool_writer", "tier_files"]

MEMORY = frozenset({Tier.MEMORY})


def spool_root(run: Run) -> Path:
    return run.dir / "spool"


def capture(seed: int, step: int) -> Capture:
    """Step 1 whole, later steps as deltas (the model of :mod:`.store_paths`)."""
    tensors: Mapping[str, TensorUpdate] = (
        {n: Full(v) for n, v in state(seed, step).items()} if step == 1 else delta(seed, step)
    )
    return Capture(step, tensors, {"step": step}, tiers=MEMORY)


def _ops(run: Run) -> list[Op]:
    return read_ops(run.history)


def _tier_state(tier: MemoryTier, seed: int, what: str, problems: list[str]) -> int | None:
    """The tier's step, its tensors checked against the model's state at that step."""
    with tier.export() as snap:
        if snap.empty:
            return None
        wrong = same_arrays(dict(snap.tensors), state(seed, int(snap.step or 0)))
    if wrong is not None:
        problems.append(f"{what} holds step {snap.step} with the wrong values: {wrong}")
    return snap.step


# ------------------------------------------------------------------------------------------------ spool-writer
def spool_writer(session: Session) -> None:
    root = spool_root(session.run)
    SpoolPaths(root).make()
    session.begin()
    writer = SpoolWriter(root)
    for step in (1, 2):
        session.invoke("handoff", step=step)
        handle = writer.submit(capture(session.run.seed, step))
        session.ok("handoff", seq=handle.seq, token=handle.token)
    writer.close()


def check_spool_writer(run: Run, _: Any) -> list[str]:
    ops = [o for o in _ops(run) if o.f == "handoff"]
    handed = [o.value for o in ops if o.done]
    steps = {int(o.value["step"]) for o in ops}  # handed off, or in flight
    root = spool_root(run)
    problems: list[str] = []
    tier = MemoryTier()
    agent = SpoolServer(root, tier).start(watch=False)
    try:
        agent.process_once()
        answers = _answers(root, problems)
        for h in handed:
            if answers.get(int(h["seq"]), {}).get("status") != "ok":
                problems.append(f"capture seq {h['seq']} was handed off and not applied: {answers.get(int(h['seq']))}")
        for seq, doc in sorted(answers.items()):
            if doc.get("status") != "ok":
                problems.append(f"capture seq {seq} was answered {doc.get('status')}: {doc.get('message')}")
        step = _tier_state(tier, run.seed, "the successor's tier", problems)
        last = max((int(o.value["step"]) for o in ops if o.done), default=None)
        if (step is None and last is not None) or (step is not None and (step not in steps or step < (last or 0))):
            problems.append(f"the successor's tier holds step {step}; handed off up to {last}, of {sorted(steps)}")
        left = sorted(p.name for p in (root / "incoming").iterdir())
        if left:
            problems.append(f"left in incoming/ after the successor's pass: {left}")
        with SpoolWriter(root) as writer:  # the trainer's next generation
            handle = writer.submit(capture(run.seed, 1))
            agent.process_once()
            if handle.result(timeout=0).status != "ok":
                problems.append("the next writer's whole capture was not applied")
    except PsguardError as e:
        problems.append(f"the successor failed: {type(e).__name__}: {e}")
    finally:
        agent.stop()
    return problems


def _answers(root: Path, problems: list[str]) -> dict[int, dict[str, Any]]:
    """The agent's answers in ``acks/`` by sequence number; one that does not read is a problem (torn)."""
    out: dict[int, dict[str, Any]] = {}
    for p in sorted((root / "acks").iterdir()):
        if p.name.startswith(".") or not p.name.endswith(".json") or "." in p.name[:-5]:
            continue  # temporaries; pending and durable answers
        try:
            out[int(p.name[:-5])] = json.loads(p.read_bytes())
        except ValueError as e:
            problems.append(f"the answer {p.name} does not read: {e}")
    return out


# ------------------------------------------------------------------------------------------------ spool-agent
def setup_spool_agent(run: Run) -> dict[str, Any]:
    """The trainer, alive in the checking process: two captures handed off and a restore asked for."""
    writer = SpoolWriter(spool_root(run))
    handles = [writer.submit(capture(run.seed, step)) for step in (1, 2)]
    return {"writer": writer, "captures": handles, "restore": writer.request_restore()}


def spool_agent(session: Session) -> None:
    session.begin()
    agent = SpoolServer(spool_root(session.run), MemoryTier()).start(watch=False)
    agent.process_once()
    agent.stop()


def check_spool_agent(run: Run, trainer: dict[str, Any]) -> list[str]:
    root = spool_root(run)
    problems: list[str] = []
    captures: Sequence[CaptureHandle] = trainer["captures"]
    restore: RestoreHandle = trainer["restore"]
    _answers(root, problems)
    if restore.folder.is_dir():  # the dead agent's answer: the state it held (both captures applied)
        _restored(restore.folder, run.seed, {2}, problems)
    successor = MemoryTier()
    agent = SpoolServer(root, successor).start(watch=False)
    try:
        agent.process_once()
        for h in captures:
            try:
                ack = h.result(timeout=0)
            except NeedFullCaptureError as e:  # an answer: the successor's tier lacks the delta's parent
                ack = e.ack
            except PsguardError as e:
                problems.append(f"capture seq {h.seq}: {type(e).__name__}: {e}")
                continue
            except TimeoutError:
                problems.append(f"capture seq {h.seq} was never answered")
                continue
            if ack.capture != h.token:
                problems.append(f"capture seq {h.seq} was answered for {ack.capture}, not {h.token}")
        if not restore.folder.is_dir():
            problems.append("the restore request was never answered")
        else:
            _restored(restore.folder, run.seed, {1, 2}, problems)
        _tier_state(successor, run.seed, "the successor's tier", problems)
        left = [p.name for p in (root / "incoming").iterdir()]
        left += [p.name for p in (root / "restore").iterdir() if p.name.endswith(AGENT_TMP)]
        left += [p.name for p in (root / "acks").iterdir() if p.name.startswith(".") or ".pending" in p.name]
        left += [p.name for p in (root / "requests").iterdir()]
        if left:
            problems.append(f"left after the successor's pass: {sorted(left)}")
    finally:
        agent.stop()
        trainer["writer"].close()
    return problems


def _restored(folder: Path, seed: int, steps: set[int], problems: list[str]) -> None:
    try:
        got = read_restore(folder)
    except NoCheckpointError:
        return  # a successor whose tier is empty says so
    except PsguardError as e:
        problems.append(f"the restore folder {folder.name} does not read: {e}")
        return
    if got.step not in steps:
        problems.append(f"the restore folder holds step {got.step}, expected one of {sorted(steps)}")
    elif (wrong := same_arrays(got.tensors, state(seed, got.step))) is not None:
        problems.append(f"the restore folder's step {got.step} has the wrong values: {wrong}")


# ------------------------------------------------------------------------------------------------ tier-files
TIER_NAME = "emb@0:48"
SHAPE = (48, 4)


def part_folder(run: Run) -> Path:
    return run.dir / "parts"


def tier_files(session: Session) -> None:
    seed = session.run.seed
    keys = {TIER_NAME: (ShardKey("emb", 0, SHAPE[0]), SHAPE)}
    session.begin()
    keeper = ShardKeeper(part_folder(session.run), "ps:0", tier_files=True).start()
    for step in (1, 2):
        update: TensorUpdate = Full(state(seed, 1)["emb"]) if step == 1 else delta(seed, step)["emb"]
        assert isinstance(update, Full | Rows)
        session.invoke("apply", step=step)
        parent = f"t{step - 1}" if step > 1 else None
        keeper.apply_updates({TIER_NAME: update}, keys, step=step, token=f"t{step}", parent=parent)
        session.ok("apply")
        session.invoke("export", step=step)
        answer = keeper.export({"token": f"t{step}"})
        session.ok("export", status=answer["status"], paths=[f["path"] for f in answer.get("files", [])])
    session.invoke("stop")  # an agent that stops removes its tier and its restore files
    keeper.close()
    session.ok("stop")


def check_tier_files(run: Run, _: Any) -> list[str]:
    problems: list[str] = []
    ops = _ops(run)
    for i, op in enumerate(ops):
        if op.f != "export" or not op.done or any(o.f in ("export", "stop") for o in ops[i + 1 :]):
            continue  # a later export or a stop may drop this one's files, by design
        if op.value.get("status") != "ok":
            problems.append(f"the export of step {op.value['step']} answered {op.value.get('status')}")
        for prefix in op.value.get("paths", []):
            _bundle(Path(prefix), run.seed, {int(op.value["step"])}, problems)
    folder = part_folder(run)
    restore = folder / "restore"
    for exported in sorted(restore.iterdir()) if restore.is_dir() else []:
        if not exported.name.endswith(".tmp"):
            for index in sorted(exported.glob("[0-9].index")):  # the shards' (not their fingerprints')
                _bundle(index.with_suffix(""), run.seed, {1, 2}, problems)
    try:
        keeper = ShardKeeper(folder, "ps:0", tier_files=True).start()
    except PsguardError as e:
        return [*problems, f"a successor could not start on the part folder: {e}"]
    try:
        left = [str(p.relative_to(folder)) for sub in ("incoming", "restore", "tier") for p in (folder / sub).iterdir()]
        if left:
            problems.append(f"left after a successor started: {sorted(left)}")
    finally:
        keeper.close()
    shutil.rmtree(folder, ignore_errors=True)
    return problems


def _bundle(prefix: Path, seed: int, steps: set[int], problems: list[str]) -> None:
    """The bundle at ``prefix`` reads back, verifies and holds the tier's rows at one of ``steps``."""
    if not all(p.exists() for p in bundle_files(prefix)):
        problems.append(f"the exported bundle {prefix.name} is gone")
        return
    try:
        got = read_bundle(prefix, dtype="float32", shape=SHAPE)
    except PsguardError as e:
        problems.append(f"the exported bundle {prefix.name} does not read: {e}")
        return
    if not any(np.array_equal(got, state(seed, s)["emb"]) for s in steps):
        problems.append(f"the exported bundle {prefix.name} holds none of the states of steps {sorted(steps)}")
