"""Store is a facade: each method it routes to a job is declared once, on the job, signature and docstring."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psguard.store import Store
from psguard.store.gc import Collector
from psguard.store.index import Index
from psguard.store.reader import Reader
from psguard.store.writer import Writer

ROUTED: dict[str, type] = {
    **dict.fromkeys(("checkpoint_ids", "manifest", "checkpoints", "latest", "resolve", "chain"), Index),
    **dict.fromkeys(("load", "iter_tensors", "read_rows", "updates", "load_latest"), Reader),
    **dict.fromkeys(("save", "begin_save", "write_part"), Writer),
    **dict.fromkeys(("retain", "gc"), Collector),
}


@pytest.mark.parametrize(("name", "job"), ROUTED.items())
def test_a_routed_method_is_the_jobs_own_declaration(name: str, job: type) -> None:
    facade: Callable[..., Any] = getattr(Store, name)
    declared: Callable[..., Any] = getattr(job, name)
    assert inspect.signature(facade) == inspect.signature(declared)
    assert facade.__doc__ == declared.__doc__
    assert declared.__doc__ and "documented there" not in declared.__doc__  # the callers' documentation is here


def test_routed_methods_bind_to_this_store(tmp_path: Path) -> None:
    with Store.open(str(tmp_path / "a")) as a, Store.open(str(tmp_path / "b")) as b:
        info = a.save(3, {"w": np.arange(4.0)})
        assert "self" not in inspect.signature(a.save).parameters
        assert a.checkpoint_ids() == [info.id] and b.checkpoint_ids() == []
        assert a.load(info.id)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
        assert a.retain(keep_last=1, keep_every_hours=None) is None  # one checkpoint: nothing to collect
        assert b.gc(keep_last=1).deleted_checkpoints == ()
