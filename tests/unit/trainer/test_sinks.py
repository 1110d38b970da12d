"""The save handles ``CheckpointManager.save`` returns, as the trainer's writer resolves them."""

from __future__ import annotations

import dataclasses

import pytest

from psguard.handoff.contract import Tier
from psguard.trainer.sinks import BOTH, MemoryCheckpoint, _StoreSaveHandle


def test_a_handle_waits_then_reraises_why_its_save_failed() -> None:
    handle = _StoreSaveHandle(3, 0.0, BOTH)
    assert handle.durable and not handle.done() and "pending" in repr(handle)
    with pytest.raises(TimeoutError, match="step 3 not durable"):
        handle.result(0.01)
    with pytest.raises(TimeoutError):
        handle.exception(0.01)  # a timeout is not the save's failure
    handle.future.set_exception(PermissionError("disk on fire"))
    assert handle.done() and "done" in repr(handle)
    assert isinstance(handle.exception(0), PermissionError)
    with pytest.raises(PermissionError):
        handle.restorable(0)  # without an agent, restorable means committed


def test_a_memory_only_save_is_not_durable_and_its_checkpoint_is_a_value() -> None:
    assert not _StoreSaveHandle(1, 0.0, frozenset({Tier.MEMORY})).durable
    checkpoint = MemoryCheckpoint(step=5, token="t")
    assert checkpoint == MemoryCheckpoint(5, "t")
    with pytest.raises(dataclasses.FrozenInstanceError):
        checkpoint.step = 6  # type: ignore[misc]
