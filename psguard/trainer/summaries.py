"""psguard's figures in TensorBoard: the chief writes its own scalars with ``tf.summary`` beside the loss curves,
each at the training step it happened at: ``psguard/capture_stall_seconds``, ``psguard/save_bytes`` (what a save
handed off), ``psguard/held_seconds`` (waiting for the durable log), ``psguard/durable_lag_steps`` and
``psguard/durable_lag_seconds`` (after a save), ``psguard/restores/{memory,durable}``, ``psguard/restore_seconds``
and ``psguard/lost_steps`` (steps trained past the restored state, when this process knows them).

Off unless a folder is named (``ManagerOptions(summaries=...)``); the writer is made at the first scalar and
closed with the manager. It never raises into training: the first failure is logged once and turns writing off.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from psguard.dependencies import import_optional
from psguard.handoff.parts import PartCapture
from psguard.tensors import Full, Rows, TensorUpdate
from psguard.trainer.durable_lag import LagStatus
from psguard.trainer.variables import TensorInfo

tf: Any = import_optional("tensorflow")

log = logging.getLogger(__name__)

#: Bytes of one row id, as the captures hand them off (int64).
_ID_BYTES = 8


class Summaries:
    """The chief's scalars in ``logdir`` (any folder ``tf.summary`` takes: a path, ``gs://...``)."""

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        self.logdir = os.fspath(logdir)
        self._writer: Any = None
        self._off = False
        self._captured_at: int | None = None  # the step of the last capture: its hold is written too

    def captured(self, step: int, stall_seconds: float, nbytes: int) -> None:
        """A save at ``step`` stalled training ``stall_seconds`` and handed off ``nbytes``."""
        self._captured_at = step
        self._write(step, {"psguard/capture_stall_seconds": stall_seconds, "psguard/save_bytes": nbytes})

    def held(self, step: int, seconds: float, lag: Callable[[], LagStatus]) -> None:
        """Training at ``step`` waited ``seconds`` for the durable log; written at a save's step (with ``lag()``
        after it) and at any step that waited."""
        if step != self._captured_at and seconds <= 0:
            return
        scalars: dict[str, float] = {"psguard/held_seconds": seconds}
        if step == self._captured_at:
            self._captured_at = None
            status = lag()
            scalars |= {"psguard/durable_lag_steps": status.steps, "psguard/durable_lag_seconds": status.seconds}
        self._write(step, scalars)

    def restored(self, step: int, source: str, seconds: float, lost_steps: int | None) -> None:
        """A restore of ``step`` from ``source`` took ``seconds``; ``lost_steps`` when this process knows them."""
        scalars: dict[str, float] = {f"psguard/restores/{source}": 1, "psguard/restore_seconds": seconds}
        if lost_steps is not None:
            scalars["psguard/lost_steps"] = lost_steps
        self._write(step, scalars)

    def close(self) -> None:
        """Flush what is written and release the writer (a closed writer makes a new one if written to)."""
        writer, self._writer = self._writer, None
        if writer is None or self._off:
            return
        try:
            writer.close()  # flushes first
        except Exception as e:  # never into training (see the module doc)
            self._fail(e)

    def _write(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._off:
            return
        try:
            if self._writer is None:
                self._writer = tf.summary.create_file_writer(self.logdir)
            # record_if(True): the Keras TensorBoard callback's own record_if may still be in force.
            with self._writer.as_default(), tf.summary.record_if(True):
                for tag, value in scalars.items():
                    tf.summary.scalar(tag, float(value), step=int(step))
        except Exception as e:  # never into training (see the module doc)
            self._fail(e)

    def _fail(self, error: BaseException) -> None:
        self._off = True
        writer, self._writer = self._writer, None
        log.warning(
            "event=summaries_off logdir=%s error=%r: psguard's TensorBoard scalars could not be written there and "
            "are off for this manager; training goes on. Fix: give summaries= a folder this process can write",
            self.logdir,
            " ".join(str(error).split())[:300],
        )
        if writer is not None:
            with contextlib.suppress(Exception):  # already off and logged
                writer.close()


def handed_off_bytes(
    updates: Mapping[str, TensorUpdate], parts: Iterable[PartCapture], tensors: Mapping[str, TensorInfo]
) -> int:
    """The bytes a capture handed off: whole values, changed rows and their ids, and the rows the PS nodes
    wrote into files (``parts``, sized by the capturer's ``tensors``)."""
    total = 0
    for update in updates.values():
        if isinstance(update, Full) and update.value.dtype.kind == "O":  # the object graph, strings: their lengths
            total += sum(len(item) for item in update.value.flat if isinstance(item, bytes | str))
        elif isinstance(update, Full):
            total += int(update.value.nbytes)
        elif isinstance(update, Rows):
            total += update.values.nbytes + update.ids.nbytes
    for part in parts:
        for shard in part.shards:
            row = tensors[shard.key.name].row_bytes
            total += shard.count * (row + (_ID_BYTES if shard.kind == "rows" else 0))
    return total
