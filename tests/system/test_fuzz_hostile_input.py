"""Property-based fuzzing (hypothesis) of what psguard reads from others: manifest bodies, spool captures and
command lines. Every input must end in a psguard error with its documented exit code (or succeed): never another
exception, a traceback, a hang (pytest-timeout and hypothesis deadlines) or an allocation sized by a claim
(tracemalloc peaks).

The fast part runs a few hundred examples in-process (< 60 s); the part that starts real ``psguard`` processes
is ``slow``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psguard import cli
from psguard.errors import CheckpointError, CorruptCheckpointError, NoCheckpointError, PsguardError
from psguard.handoff.spool import Capture, read_capture, write_capture_files
from psguard.store import Store
from psguard.store.manifest import manifest_key, parse_manifest
from psguard.tensors import Full, Rows, Same

FAST = settings(
    max_examples=120,
    deadline=5000,  # ms per example: a hang or a quadratic parse fails here
    derandomize=True,  # the same examples in every run: a failure reproduces
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
#: Peak traced allocation allowed while reading one hostile input: far below any claim the fuzzer makes.
PEAK = 32 << 20

# ------------------------------------------------------------------------------------------------ values
HUGE_INTS = st.sampled_from([-1, 0, 1, 2**31, 2**63 - 1, 2**63, 10**12, 10**18, 10**40])
NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70), HUGE_INTS, st.floats(allow_nan=False, allow_infinity=False), st.just(0.5)
)
SCALARS = st.one_of(
    st.none(), st.booleans(), NUMBERS, st.text(max_size=20), st.sampled_from(["O", "float32", "string"])
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
#: Text only a hostile writer produces: what ``json.dumps`` cannot, spliced into a document.
RAW = st.sampled_from(
    ["NaN", "Infinity", "-Infinity", "1e999", "9" * 5000, "[" * 20_000 + "]" * 20_000, '"\\ud800"', "1" * 25]
)


def _seal(doc: dict[str, Any]) -> bytes:
    canonical = json.dumps(doc["body"], sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    doc["sha256"] = hashlib.sha256(canonical).hexdigest()
    return json.dumps(doc).encode()


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path to a value inside ``doc`` (keys and list indexes)."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


def _put(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return doc


# ------------------------------------------------------------------------------------------------ manifests
@pytest.fixture(scope="module")
def base_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """A store with a full checkpoint and a delta over it: the documents the fuzzer mutates."""
    root = tmp_path_factory.mktemp("fuzz") / "store"
    t = np.arange(64, dtype=np.float32).reshape(16, 4)
    with Store.open(str(root)) as s:
        full = s.save(10, {"w": t, "s": np.array([b"ab", b"c"], dtype=object), "k": np.array(3, np.int64)}).id
        t[2] = 0
        delta = s.save(
            20,
            {"w": Rows(np.array([2]), t[2:3], t.shape), "s": Same((2,), np.dtype(object)), "k": np.array(4, np.int64)},
            parent=full,
        ).id
    return root, full, delta


def _read_everything(root: Path, cid: str) -> None:
    """What ls, verify, inspect, restore and gc's selection do with a checkpoint; only psguard errors may escape."""
    with Store.open(str(root)) as store:
        store.checkpoints()
        report = store.verify(cid)
        assert report.ok or report.problems
        with contextlib.suppress(CheckpointError):
            store.load(cid)
        with contextlib.suppress(NoCheckpointError):  # when the fuzzer damaged the base, nothing is usable
            store.load_latest()


@FAST
@given(data=st.data())
def test_any_manifest_is_read_or_refused_as_corrupt(
    base_store: tuple[Path, str, str], tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    root, full, delta = base_store
    cid = data.draw(st.sampled_from([full, delta]), label="checkpoint")
    doc = json.loads((root / manifest_key(cid)).read_text())
    path = data.draw(st.sampled_from(list(_paths(doc["body"]))), label="path")
    how = data.draw(st.sampled_from(["value", "raw", "delete"]), label="how")
    if how == "delete" and path:
        node = doc["body"]
        for k in path[:-1]:
            node = node[k]
        del node[path[-1]]
        blob = _seal(doc)
    elif how == "raw":
        marker = "__FUZZ__"
        _put(doc["body"], path, marker)
        blob = json.dumps(doc).replace(f'"{marker}"', data.draw(RAW, label="raw"), 1).encode()
    else:
        _put(doc["body"], path, data.draw(JSON, label="value"))
        try:
            blob = _seal(doc)
        except ValueError:
            return
    work = tmp_path_factory.mktemp("case") / "store"
    shutil.copytree(root, work)
    (work / manifest_key(cid)).write_bytes(blob)
    tracemalloc.start()
    try:
        with contextlib.suppress(CorruptCheckpointError):
            parse_manifest(blob, expected_id=cid)
        _read_everything(work, cid)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        shutil.rmtree(work.parent, ignore_errors=True)
    assert peak < PEAK, peak


# ------------------------------------------------------------------------------------------------ spool captures
@pytest.fixture(scope="module")
def capture_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("capture") / "000000000007"
    folder.mkdir()
    t = np.arange(12, dtype=np.float32).reshape(3, 4)
    capture = Capture(
        7, {"w": Full(t), "r": Rows(np.array([1]), t[1:2], t.shape), "s": Same((3, 4), np.dtype(np.float32))}
    )
    entries = write_capture_files(folder, capture)
    doc = {"format": "psguard-spool-capture", "version": 1, "seq": 7, "writer": "0000abcd", "token": "0000abcd-7",
           "parent": None, "step": 7, "tiers": ["memory"], "metadata": {}, "metrics": {}, "created_at": 1.0,
           "tensors": entries}  # fmt: skip
    (folder / "capture.json").write_text(json.dumps(doc))
    read_capture(folder)  # the unmutated capture reads
    return folder


@FAST
@given(data=st.data())
def test_any_spool_capture_is_read_or_refused_as_corrupt(
    capture_folder: Path, tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    doc = json.loads((capture_folder / "capture.json").read_text())
    path = data.draw(st.sampled_from(list(_paths(doc))), label="path")
    work = tmp_path_factory.mktemp("spool") / capture_folder.name
    shutil.copytree(capture_folder, work)
    if data.draw(st.booleans(), label="raw"):
        _put(doc, path, "__FUZZ__")
        text = json.dumps(doc).replace('"__FUZZ__"', data.draw(RAW, label="raw"), 1)
    else:
        text = json.dumps(_put(doc, path, data.draw(JSON, label="value")), allow_nan=True)
    (work / "capture.json").write_text(text)
    victim = data.draw(st.sampled_from(["", "0.bin", "1.ids", "1.bin"]), label="file")
    if victim and data.draw(st.booleans(), label="replace file"):
        (work / victim).unlink()
        kind = data.draw(st.sampled_from(["fifo", "folder", "short"]), label="kind")
        if kind == "fifo":
            os.mkfifo(work / victim)
        elif kind == "folder":
            (work / victim).mkdir()
        else:
            (work / victim).write_bytes(b"\0")
    tracemalloc.start()
    try:
        read_capture(work)
    except CorruptCheckpointError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        shutil.rmtree(work.parent, ignore_errors=True)
    assert peak < PEAK, peak


# ------------------------------------------------------------------------------------------------ command lines
@pytest.fixture(scope="module")
def places(base_store: tuple[Path, str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Arguments a user may pass: a good store, a missing one, a file, a FIFO, a folder, a path under a file."""
    root, _, _ = base_store
    d = tmp_path_factory.mktemp("places")
    (d / "file").write_text("x")
    os.mkfifo(d / "fifo")
    (d / "folder").mkdir()
    bad = d / "bad-store"
    shutil.copytree(root, bad)
    (bad / manifest_key(sorted(p.stem for p in (bad / "manifests").iterdir())[-1])).write_text("NaN")
    return {"store": str(root), "bad": str(bad), "missing": str(d / "missing"), "file": str(d / "file"),
            "fifo": str(d / "fifo"), "folder": str(d / "folder"), "under-file": str(d / "file" / "x"),
            "s3-bad-bucket": "s3://Bad_Bucket!/x", "bad-url": "s3:/x"}  # fmt: skip


TEXT = st.one_of(
    st.sampled_from(["0", "-1", "nan", "inf", "-inf", "1e999", "9" * 400, "", "1h", "99999999999d", "0.0001ms"]),
    st.text(max_size=12),
)


def _argv(data: st.DataObject, places: dict[str, str]) -> list[str]:
    place = st.sampled_from(sorted(places)).map(places.__getitem__)
    command = data.draw(st.sampled_from(["ls", "verify", "gc", "inspect", "compact", "copy", "policy"]), label="cmd")
    if command == "policy":
        action = data.draw(st.sampled_from(["check", "simulate", "show"]), label="action")
        target = data.draw(st.one_of(place, st.sampled_from(["default", "nonesuch"]), TEXT), label="file")
        argv = ["policy", action, target]
        if action == "simulate":
            for flag in ("--mtbf", "--stall", "--persist", "--duration"):
                argv += [flag, data.draw(st.one_of(TEXT, st.sampled_from(["6h", "0.5s", "20s", "1d"])), label=flag)]
        return argv
    argv = [command, data.draw(place, label="url")]
    if command == "gc":
        argv += data.draw(
            st.lists(st.sampled_from(["--keep-last", "--keep-every-hours", "--dry-run"]), max_size=3), label="gc"
        )
        argv = [a for flag in argv for a in ([flag, data.draw(TEXT)] if flag.startswith("--keep") else [flag])]
    if command in ("verify", "inspect", "compact", "copy"):
        which = data.draw(st.sampled_from(["", "--step", "--id"]), label="target")
        if which or command == "copy":
            argv += [which or "--step", data.draw(st.one_of(TEXT, st.sampled_from(["10", "20", "000000000010-0"])))]
    if command == "copy":
        argv.append(data.draw(place, label="dest"))
    if command in ("verify", "compact", "copy"):
        argv.append("--quiet")
    if data.draw(st.booleans(), label="json") and command != "policy":
        argv.append("--json")
    return argv


DOCUMENTED = {cli.EXIT_OK, cli.EXIT_ERROR, cli.EXIT_USAGE, cli.EXIT_CORRUPT, cli.EXIT_NOT_FOUND}


@settings(FAST, max_examples=150)
@given(data=st.data())
def test_any_command_line_ends_in_a_documented_exit_code_without_a_traceback(
    places: dict[str, str], data: st.DataObject, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _argv(data, places)
    capsys.readouterr()
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse: a usage error
        code = e.code if isinstance(e.code, int) else 1
    _, err = capsys.readouterr()
    assert "Traceback" not in err, (argv, err)
    assert code in DOCUMENTED, (argv, code, err)
    if code == cli.EXIT_ERROR:  # exit 1 is kept for storage failures and the like: none of these inputs is one
        pytest.fail(f"{argv}: exit 1 for bad input: {err}")
    url = argv[1] if argv[0] != "policy" else None
    if url == places["missing"]:
        assert code in (cli.EXIT_USAGE, cli.EXIT_NOT_FOUND), (argv, code, err)  # argparse may refuse an option first
    if url == places["bad"] and argv[0] == "ls":
        assert code == cli.EXIT_CORRUPT, (argv, code, err)


def test_a_psguard_error_is_what_the_library_raises_for_a_hostile_manifest(base_store: tuple[Path, str, str]) -> None:
    root, full, _ = base_store
    doc = json.loads((root / manifest_key(full)).read_text())
    doc["body"]["tensors"]["w"]["shape"] = [10**12, 4]
    with pytest.raises(PsguardError):
        parse_manifest(_seal(doc), expected_id=full)


# ------------------------------------------------------------------------------------------------ real processes
@pytest.mark.slow
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_real_psguard_processes_end_with_a_documented_exit_code(places: dict[str, str], data: st.DataObject) -> None:
    argv = _argv(data, places)
    done = subprocess.run(
        [sys.executable, "-m", "psguard.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert "Traceback" not in done.stderr, (argv, done.stderr)
    assert done.returncode in DOCUMENTED - {cli.EXIT_ERROR}, (argv, done.returncode, done.stderr)
