"""Hostile and damaged manifests and journal entries on a real local store (issue 13, items 5 and 6).

Each case writes a good checkpoint, then a newer one whose manifest is rewritten the way an attacker or a
damaged disk would (its SHA-256 recomputed where the damage must get past it), and checks that: every store
command ends in exit 3 with a one-line message and no traceback; ``load_latest`` falls back to the older good
checkpoint and says which it skipped and why; nothing is allocated from a size the manifest only claims.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psguard import cli
from psguard.errors import ConfigError, CorruptCheckpointError
from psguard.store import Store
from psguard.store.manifest import manifest_key, parse_manifest
from psguard.tensors import Rows

Body = dict[str, Any]


def _seal(doc: dict[str, Any]) -> bytes:
    """The manifest with its checksum recomputed over the (edited) body, as a forger would."""
    canonical = json.dumps(doc["body"], sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    doc["sha256"] = hashlib.sha256(canonical).hexdigest()
    return json.dumps(doc).encode()


def _store(tmp_path: Path, *, delta: bool = False) -> tuple[Path, str, str]:
    """A store with a good checkpoint (step 10) and a newer one (step 20) to damage."""
    root = tmp_path / "store"
    t = np.arange(64, dtype=np.float32).reshape(16, 4)
    with Store.open(str(root)) as s:
        good = s.save(10, {"w": t, "b": np.ones(3, np.int64)}).id
        t2 = t.copy()
        t2[3] = -1
        if delta:
            newest = s.save(20, {"w": Rows(np.array([3]), t2[3:4], t2.shape), "b": np.ones(3, np.int64)}, parent=good)
        else:
            newest = s.save(20, {"w": t2, "b": np.ones(3, np.int64)})
    return root, good, newest.id


def _rewrite(root: Path, cid: str, edit: Callable[[dict[str, Any]], bytes]) -> None:
    path = root / manifest_key(cid)
    path.write_bytes(edit(json.loads(path.read_text())))


def _body_edit(change: Callable[[Body], None]) -> Callable[[dict[str, Any]], bytes]:
    def edit(doc: dict[str, Any]) -> bytes:
        change(doc["body"])
        return _seal(doc)

    return edit


def _text_edit(old: str, new: str) -> Callable[[dict[str, Any]], bytes]:
    """Edit the JSON text (for what ``json.dumps`` cannot produce: NaN bodies with a valid checksum don't exist)."""

    def edit(doc: dict[str, Any]) -> bytes:
        text = json.dumps(doc)
        assert old in text
        return text.replace(old, new, 1).encode()

    return edit


def _set(path: str, value: Any) -> Callable[[Body], None]:
    def change(body: Body) -> None:
        *keys, last = path.split(".")
        node: Any = body
        for k in keys:
            node = node[k] if not k.isdigit() else node[int(k)]
        node[int(last) if last.isdigit() else last] = value

    return change


def _rename(old: str, new: str) -> Callable[[Body], None]:
    """Tensor ``old`` listed under the name ``new`` instead."""

    def change(body: Body) -> None:
        body["tensors"][new] = body["tensors"].pop(old)

    return change


CASES: dict[str, tuple[Callable[[dict[str, Any]], bytes], str]] = {
    "nan": (_text_edit('"committed_at": ', '"committed_at": NaN, "x": '), "NaN is not a JSON number"),
    "infinity-literal": (_text_edit('"committed_at": ', '"committed_at": 1e999, "x": '), "out of range"),
    "deep-nesting": (_text_edit('"metadata": {}', '"metadata": ' + "[" * 50_000 + "]" * 50_000), "nested more than"),
    "5000-digit-integer": (_text_edit('"chain_length": 0', '"chain_length": ' + "9" * 5000), "5000 digits"),
    "10^12-rows": (_body_edit(_set("tensors.w.shape", [10**12, 4])), "its chunks declare"),
    "dtype-O": (_body_edit(_set("tensors.w.dtype", "O")), "is not a dtype psguard stores"),
    "unknown-dtype": (_body_edit(_set("tensors.w.dtype", "datetime64")), "is not a dtype psguard stores"),
    "step-differs-from-id": (_body_edit(_set("step", 5)), "its body says step 5 but its id says step 20"),
    "metrics-not-numbers": (_body_edit(_set("metrics", {"loss": {"a": 1}})), "not a number"),
    "stats-negative": (_body_edit(_set("stats", {"logical_bytes": -1})), "negative"),
    "too-many-dims": (_body_edit(_set("tensors.b.shape", [1] * 40)), "non-negative dimensions"),
    "full-with-foreign-base": (_body_edit(_set("base", "000000000010-00000000")), "its own base"),
    "committed-in-year-1e292": (_body_edit(_set("committed_at", 1e300)), "is not a time"),
    "committed-before-1970": (_body_edit(_set("committed_at", -1.0)), "is not a time"),
    "name-climbs-out": (_body_edit(_rename("b", "../../../../tmp/x")), "has a '..' part"),
    "name-absolute": (_body_edit(_rename("b", "/etc/cron.d/x")), "starts with '/'"),
    "name-with-nul": (_body_edit(_rename("b", "b\x00.txt")), "has a control character"),
    "name-with-newline": (_body_edit(_rename("b", "b\nevent=forged")), "has a control character"),
    "name-empty-part": (_body_edit(_rename("b", "model//b")), "empty part"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_manifest_is_corrupt_everywhere_and_restore_falls_back(
    tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    root, good, bad = _store(tmp_path)
    edit, why = CASES[case]
    _rewrite(root, bad, edit)

    with pytest.raises(CorruptCheckpointError, match=why) as raised:
        parse_manifest((root / manifest_key(bad)).read_bytes(), expected_id=bad)
    assert raised.value.checkpoint == bad

    with caplog.at_level(logging.WARNING, logger="psguard.store.reader"), Store.open(str(root)) as store:
        loaded = store.load_latest()
        assert loaded.info.id == good and loaded.info.step == 10
        assert [p.checkpoint for p in loaded.skipped] == [bad] and why in loaded.skipped[0].message
        assert [i.id for i in store.checkpoints()] == [good]
    assert f"checkpoint {bad} is unusable" in caplog.text and "falling back" in caplog.text

    # Every store command, in-process (fast) through the CLI's own error mapping: exit 3, one line, no traceback.
    for argv in (["ls"], ["verify"], ["verify", "--id", bad], ["inspect", "--id", bad], ["compact", "--id", bad]):
        capsys.readouterr()
        code = cli.main([argv[0], str(root), *argv[1:], "--quiet"] if argv[0] in ("verify", "compact") else
                        [argv[0], str(root), *argv[1:]])  # fmt: skip
        out, err = capsys.readouterr()
        assert code == cli.EXIT_CORRUPT, (argv, out, err)
        assert "Traceback" not in err and why in out + err, (argv, out, err)
    capsys.readouterr()
    assert cli.main(["gc", str(root), "--keep-last", "1"]) == 0  # leaves the unreadable manifest alone
    assert (root / manifest_key(bad)).exists() and (root / manifest_key(good)).exists()


def test_the_cli_in_a_real_process_exits_3_without_a_traceback(tmp_path: Path) -> None:
    root, _, bad = _store(tmp_path)
    _rewrite(root, bad, CASES["deep-nesting"][0])
    for command in ("ls", "verify", "inspect", "gc"):
        extra = ["--keep-last", "1"] if command == "gc" else ["--id", bad] if command == "inspect" else []
        done = subprocess.run(
            [sys.executable, "-m", "psguard.cli", command, str(root), *extra],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "Traceback" not in done.stderr, done.stderr
        assert done.returncode == (0 if command == "gc" else cli.EXIT_CORRUPT), (command, done.stdout, done.stderr)


def test_a_chunk_that_claims_a_terabyte_is_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    """The claim agrees with the shape (so the manifest parses); the chunk in the store is 1 KiB. Verify and
    restore ask the store for the chunk's real size before allocating: peak traced memory stays tiny."""
    root = tmp_path / "store"
    with Store.open(str(root)) as s:
        good = s.save(10, {"w": np.zeros((64, 4), np.float32)}).id
        bad = s.save(20, {"w": np.ones((64, 4), np.float32)}).id
    claim = 10**12

    def lie(body: Body) -> None:
        body["tensors"]["w"]["chunks"][0]["size"] = claim
        body["tensors"]["w"]["shape"] = [claim // 16, 4]

    _rewrite(root, bad, _body_edit(lie))
    with Store.open(str(root)) as store:
        tracemalloc.start()
        try:
            report = store.verify(bad)
            loaded = store.load_latest()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert not report.ok
    assert "has 1024 bytes in the store, its manifest claims 1000000000000" in report.problems[0].message
    assert loaded.info.id == good and loaded.skipped[0].checkpoint == bad
    assert peak < 16 << 20, peak


def test_a_delta_whose_rows_disagree_with_their_chunk_sizes_is_corrupt(tmp_path: Path) -> None:
    root, good, bad = _store(tmp_path, delta=True)
    _rewrite(root, bad, _body_edit(_set("tensors.w.segments.0.count", 10**9)))
    with Store.open(str(root)) as store:
        report = store.verify(bad)
        assert not report.ok and "chunk sizes do not match" in report.problems[0].message
        assert store.load_latest().info.id == good


def test_verify_refuses_a_chain_that_cannot_be_restored_although_every_chunk_is_sound(tmp_path: Path) -> None:
    """A delta that changes a tensor's dtype against its parent (its rows still fit their chunks) has sound
    chunks; restore refuses it, so verify must too."""
    root, good, bad = _store(tmp_path, delta=True)
    _rewrite(root, bad, _body_edit(_set("tensors.w.dtype", "int32")))  # same item size: the rows still fit
    with Store.open(str(root)) as store:
        report = store.verify(bad)
        assert not report.ok and "changes dtype/shape along the chain" in report.problems[0].message
        assert store.verify(good).ok
        assert store.load_latest().info.id == good


@pytest.mark.parametrize("added", [None, "../../../../tmp/x"], ids=["dropped", "dropped-and-path-added"])
def test_a_resealed_delta_that_drops_a_tensor_of_its_parent_is_refused(
    tmp_path: Path, added: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    """The format says a delta lists every tensor of its parent: one that drops ``b`` (and, as found, lists a
    tensor named ``../../../../tmp/x`` in its place) is refused by verify and every read, naming the tensor."""
    root, good, bad = _store(tmp_path, delta=True)

    def drop(body: Body) -> None:
        b = body["tensors"].pop("b")
        if added is not None:
            body["tensors"][added] = b

    _rewrite(root, bad, _body_edit(drop))
    why = "does not list tensor 'b'" if added is None else "has a '..' part"
    with Store.open(str(root)) as store:
        report = store.verify(bad)
        assert not report.ok and why in report.problems[0].message
        with pytest.raises(CorruptCheckpointError, match=why):
            store.load(bad)
        loaded = store.load_latest()
        assert loaded.info.id == good and why in loaded.skipped[0].message
        assert store.verify(good).ok
    capsys.readouterr()
    assert cli.main(["verify", str(root), "--id", bad, "--quiet"]) == cli.EXIT_CORRUPT
    out, err = capsys.readouterr()
    assert why in out + err and "Traceback" not in err


def test_export_refuses_a_tensor_name_that_is_a_path_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, _, bad = _store(tmp_path)
    _rewrite(root, bad, CASES["name-climbs-out"][0])
    out = tmp_path / "export"
    capsys.readouterr()
    assert cli.main(["export", str(root), str(out), "--id", bad]) == cli.EXIT_CORRUPT
    printed, err = capsys.readouterr()
    assert "has a '..' part" in printed + err and "Traceback" not in err
    assert not out.exists() or list(out.iterdir()) == []


def test_a_save_of_a_dtype_no_reader_restores_is_refused(tmp_path: Path) -> None:
    with Store.open(str(tmp_path / "store")) as store, pytest.raises(ConfigError, match="cannot be checkpointed"):
        store.save(1, {"t": np.zeros(3, dtype="datetime64[s]")})


@pytest.mark.parametrize(
    "entry",
    [
        b'{"id": "000000000020-00000000", "step": NaN}',
        b"[" * 100_000,
        b'{"id": "000000000020-00000000", "step": ' + b"9" * 5000 + b"}",
        b'{"id": "000000000020-00000000", "step": 7, "kind": "full", "parent": null, "committed_at": 1}',
        b'{"id": "000000000020-00000000", "step": 20, "kind": "full", "parent": null, "committed_at": 1e300}',
    ],
    ids=["nan", "deep", "5000-digits", "step-differs", "committed-in-year-1e292"],
)
def test_a_hostile_journal_entry_is_skipped_with_a_warning(
    tmp_path: Path, entry: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    root, good, bad = _store(tmp_path)
    (root / "journal" / "000000000099.json").write_bytes(entry)
    with caplog.at_level(logging.WARNING, logger="psguard.store.writer"), Store.open(str(root)) as store:
        assert [j["id"] for j in store.journal()] == [good, bad]
    assert "skipping journal entry journal/000000000099.json" in caplog.text


@pytest.mark.slow
def test_a_chief_agent_resuming_from_the_store_falls_back_past_a_hostile_manifest(tmp_path: Path) -> None:
    """A real ``psguard agent --role chief --store``: its resume skips the hostile newest checkpoint, says why in
    its log, seeds its memory tier from the older good one and runs its task."""
    from tests.support.agents import lone_chief_agent

    root, good, bad = _store(tmp_path)
    _rewrite(root, bad, CASES["5000-digit-integer"][0])
    config = tmp_path / "agent.yaml"  # its own state folder: other agents on this machine keep theirs
    config.write_text(f"state_dir: {tmp_path / 'agents'}\n")
    argv = lone_chief_agent(tmp_path, root, [sys.executable, "-c", "pass"], "--config", str(config))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"checkpoint {bad} is unusable" in done.stderr and "5000 digits" in done.stderr, done.stderr[-3000:]
    assert f"restored checkpoint {good} (step 10) after skipping 1 newer" in done.stderr, done.stderr[-3000:]
