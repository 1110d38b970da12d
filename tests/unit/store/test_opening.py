"""psguard.store.opening: a store opened on a thread gives the store, or the open's error, to whoever waits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from psguard.errors import PsguardError
from psguard.store.opening import StoreOpening


def test_the_store_opened_on_a_thread_is_the_store(tmp_path: Path) -> None:
    opening = StoreOpening(str(tmp_path / "log"))
    store = opening.wait()
    info = store.save(1, {"w": np.arange(6, dtype=np.float32)})
    assert opening.checkpoint_ids() == store.checkpoint_ids() == [info.id]  # any attribute is the store's
    opening.close()


def test_the_opens_error_reaches_every_caller() -> None:
    opening = StoreOpening("nosuchscheme://bucket/job")
    with pytest.raises(PsguardError) as first:
        opening.wait()
    with pytest.raises(PsguardError) as second:
        opening.checkpoint_ids()  # any attribute waits for the open
    assert first.value is second.value
    opening.close()  # nothing to close: no error
