"""The store CLI as a user runs it: a real subprocess, its output and its documented exit codes."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psguard import cli, progress
from psguard.storage.base import Backend
from psguard.storage.metered import MeteredBackend
from psguard.store import Store, facade
from psguard.store import verify as verify_module
from psguard.store.index import Index
from psguard.store.manifest import CHUNK_PREFIX, chunk_key
from psguard.tensors import Rows


def psguard(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "psguard.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def populated(tmp_path: Path) -> tuple[str, list[str]]:
    url = str(tmp_path / "store")
    t = np.arange(4000, dtype=np.float32).reshape(1000, 4)
    with Store.open(url, chunk_bytes=2048) as s:
        ids = [s.save(10, {"emb": t.copy(), "names": np.array([b"a"], dtype=object)}).id]
        for step in (20, 30):
            t[step] = -1
            upd = {"emb": Rows(np.array([step]), t[step : step + 1], t.shape), "names": np.array([b"b"], dtype=object)}
            ids.append(s.save(step, upd, parent=ids[-1]).id)
    return url, ids


def test_ls_json_and_table(populated: tuple[str, list[str]]) -> None:
    url, ids = populated
    out = psguard("ls", url, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [c["id"] for c in doc["checkpoints"]] == ids
    assert [c["kind"] for c in doc["checkpoints"]] == ["full", "delta", "delta"]
    assert doc["checkpoints"][1]["parent"] == ids[0]
    assert doc["checkpoints"][1]["stored_bytes"] < doc["checkpoints"][0]["stored_bytes"]
    table = psguard("ls", url)
    assert table.returncode == 0 and ids[2] in table.stdout and "delta" in table.stdout


def test_inspect_shows_tensors(populated: tuple[str, list[str]]) -> None:
    url, ids = populated
    out = psguard("inspect", url, "--step", "30", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["id"] == ids[2]
    assert doc["tensors"]["emb"] == {
        "dtype": "float32",
        "shape": [1000, 4],
        "encoding": "rows",
        "chunks": 2,
        "rows_changed": 1,
    }
    assert doc["tensors"]["names"]["dtype"] == "string"


def test_verify_exit_codes(populated: tuple[str, list[str]]) -> None:
    url, ids = populated
    ok = psguard("verify", url)
    assert ok.returncode == 0 and ok.stdout.count(": ok") == 3
    with Store.open(url) as s:
        ref = s.manifest(ids[0]).tensors["emb"].chunks[1]
        path = Path(url) / chunk_key(ref.hash)
    data = bytearray(path.read_bytes())
    data[5] ^= 0xFF
    path.write_bytes(data)
    bad = psguard("verify", url, "--json")
    assert bad.returncode == 3
    doc = json.loads(bad.stdout)
    assert not doc["ok"]
    # the base is damaged, so every checkpoint built on it is reported, each naming the chunk
    assert all(r["problems"][0]["chunk"] == ref.hash for r in doc["reports"])
    one = psguard("verify", url, "--step", "30")
    assert one.returncode == 3 and ref.hash in one.stdout
    missing = psguard("verify", url, "--step", "99")
    assert missing.returncode == 4 and "no checkpoint at step 99" in missing.stderr


def test_compact_then_gc(populated: tuple[str, list[str]]) -> None:
    url, ids = populated
    out = psguard("compact", url, "--json")
    assert out.returncode == 0, out.stderr
    new_id = json.loads(out.stdout)["compacted"]["id"]
    gc = psguard("gc", url, "--keep-last", "1", "--json")
    assert gc.returncode == 0, gc.stderr
    assert sorted(json.loads(gc.stdout)["deleted_checkpoints"]) == sorted(ids)
    ls = json.loads(psguard("ls", url, "--json").stdout)
    assert [c["id"] for c in ls["checkpoints"]] == [new_id]
    assert psguard("verify", url).returncode == 0


def test_bad_input_gets_a_clear_error(tmp_path: Path) -> None:
    out = psguard("ls", "ftp://host/x")
    assert out.returncode == 2 and "unknown storage scheme 'ftp'" in out.stderr
    out = psguard("gc", str(tmp_path), "--keep-last", "0")
    assert out.returncode == 2 and "keeps nothing" in out.stderr
    out = psguard("ls", str(tmp_path / "nothing-here"))
    assert out.returncode == 4 and out.stderr.count("\n") == 1 and "the folder does not exist" in out.stderr
    out = psguard("ls", str(tmp_path), "-o", "novalue")
    assert out.returncode == 2 and "KEY=VALUE" in out.stderr


def test_demo_runs_and_restores_identically(tmp_path: Path) -> None:
    args = ["--quick", "--dir", str(tmp_path / "demo"), "--steps", "60", "--every", "10", "--users", "20000"]
    out = psguard("demo", *args)
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert report["checkpoints"] == 6 and report["deltas"] == 4
    assert report["verified"] and report["restored_identical"]
    assert report["mean_delta_fraction"] < 0.5


# ------------------------------------------------------------------------------------------------ copy
def test_copy_brings_a_checkpoint_and_its_chain_verified(
    populated: tuple[str, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, ids = populated
    dest = str(tmp_path / "elsewhere")
    assert cli.main(["copy", url, "--step", "30", dest, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["chain"] == ids and doc["manifests_copied"] == 3 and doc["verified"]["problems"] == []
    with Store.open(url) as src, Store.open(dest) as dst:
        assert [c.id for c in dst.checkpoints()] == ids
        want, got = src.load(ids[2]), dst.load(ids[2])
        assert all(np.array_equal(want[n], got[n]) for n in ("emb",)) and list(got["names"]) == [b"b"]
    assert cli.main(["copy", url, "--step", "30", dest]) == 0  # again: nothing to write, verified all the same
    out = capsys.readouterr().out
    assert "0 manifest(s) and 0 chunk(s)" in out and "verified there" in out


def test_copy_of_a_damaged_source_commits_nothing_past_the_damage(
    populated: tuple[str, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, ids = populated
    with Store.open(url) as s:
        ref = s.manifest(ids[0]).tensors["emb"].chunks[0]
    path = Path(url) / chunk_key(ref.hash)
    data = bytearray(path.read_bytes())
    data[3] ^= 0xFF
    path.write_bytes(data)
    dest = tmp_path / "elsewhere"
    assert cli.main(["copy", url, "--id", ids[1], str(dest)]) == cli.EXIT_CORRUPT
    assert ref.hash in capsys.readouterr().err
    assert not (dest / "manifests").exists() or not list((dest / "manifests").iterdir())


def test_copy_repairs_a_damaged_chunk_at_the_destination(
    populated: tuple[str, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, ids = populated
    dest = tmp_path / "elsewhere"
    assert cli.main(["copy", url, "--step", "10", str(dest)]) == 0
    with Store.open(url) as s:
        ref = s.manifest(ids[0]).tensors["emb"].chunks[1]
    damaged = dest / chunk_key(ref.hash)
    damaged.write_bytes(b"\0" * len(damaged.read_bytes()))
    assert cli.main(["copy", url, "--step", "30", str(dest)]) == 0
    assert cli.main(["verify", str(dest)]) == 0


def test_copy_goes_across_backends(populated: tuple[str, list[str]]) -> None:
    url, ids = populated
    dest = f"memory://copy-{ids[0]}"
    assert cli.main(["copy", url, "--id", ids[2], dest]) == 0
    with Store.open(dest) as dst:
        assert [c.id for c in dst.checkpoints()] == ids and dst.verify(ids[2]).ok


# ------------------------------------------------------------------------------------------------ missing store
@pytest.mark.parametrize(
    "command",
    [
        ["ls"],
        ["verify"],
        ["gc", "--keep-last", "1"],
        ["compact"],
        ["inspect"],
        ["copy", "--step", "1", "DEST"],
        ["export", "OUT"],
    ],
)
@pytest.mark.parametrize("spelling", ["path", "file-url"])
def test_a_missing_local_store_is_refused_not_empty(
    command: list[str], spelling: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "typo"
    url = str(missing) if spelling == "path" else f"file://{missing}"
    args = [command[0], url, *(str(tmp_path / a.lower()) if a.isupper() else a for a in command[1:])]
    assert cli.main(args) == cli.EXIT_NOT_FOUND
    err = capsys.readouterr().err.strip()
    assert err == f"psguard: error: no store at {missing}: the folder does not exist; check the URL"
    assert not missing.exists() and not (tmp_path / "dest").exists()


def test_an_empty_store_folder_lists_nothing_and_has_nothing_to_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["ls", str(tmp_path)]) == cli.EXIT_OK
    assert "no checkpoints" in capsys.readouterr().out
    assert cli.main(["verify", str(tmp_path)]) == cli.EXIT_NOT_FOUND
    assert f"no checkpoint to verify in {tmp_path}" in capsys.readouterr().err


def test_writers_still_create_a_missing_local_folder(tmp_path: Path) -> None:
    url = str(tmp_path / "new" / "store")
    with Store.open(url) as s:
        s.save(1, {"w": np.zeros(3, dtype=np.float32)})
    assert cli.main(["verify", url]) == cli.EXIT_OK


# ------------------------------------------------------------------------------------------------ progress
PLAIN_LINE = re.compile(r"^verify: \d+(\.\d)? (B|KiB|MiB) of \d+(\.\d)? (B|KiB|MiB) \(\d+%\), .+/s, ETA \S+$")


def test_plain_progress_lines_are_spaced_and_carry_bytes_rate_and_eta() -> None:
    now = [0.0]
    lines: list[str] = []

    class Sink:
        def write(self, text: str) -> None:
            lines.extend(t for t in text.split("\n") if t)

        def flush(self) -> None:
            pass

    p = progress.PlainProgress("verify", 10 << 20, Sink(), interval=5.0, clock=lambda: now[0])  # type: ignore[arg-type]
    for _ in range(10):  # 1 MiB a second for 10 seconds, reported every second
        now[0] += 1.0
        p.update(1 << 20)
    p.close()
    assert lines == [
        "verify: 5.0 MiB of 10.0 MiB (50%), 1.0 MiB/s, ETA 5s",
        "verify: 10.0 MiB of 10.0 MiB (100%), 1.0 MiB/s, ETA 0s",
        "verify: done, 10.0 MiB in 10s",
    ]


def test_verify_streams_verdicts_and_shows_plain_progress_off_a_terminal(
    populated: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url, ids = populated
    monkeypatch.setattr(progress, "PLAIN_INTERVAL", 0.0)  # a line on every read: the store is tiny
    printed_before: list[str] = []
    verify = verify_module.verify_checkpoint

    def spy(index: Index, pool: ThreadPoolExecutor, cid: str, cache: dict[str, str | None] | None) -> Any:
        printed_before.append(capsys.readouterr().out)
        return verify(index, pool, cid, cache)

    monkeypatch.setattr(verify_module, "verify_checkpoint", spy)
    assert cli.main(["verify", url]) == 0
    out, err = capsys.readouterr()
    # each verdict was on stdout before the next checkpoint's verification began
    assert printed_before[0] == "" and printed_before[1].startswith(f"{ids[0]}: ok")
    assert printed_before[2].startswith(f"{ids[1]}: ok") and out.startswith(f"{ids[2]}: ok")
    err_lines = err.splitlines()
    assert err_lines and all(PLAIN_LINE.match(x) for x in err_lines[:-1]), err
    assert err_lines[-1].startswith("verify: done, ")
    assert cli.main(["verify", url, "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_verify_json_is_one_document_at_the_end(
    populated: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url, ids = populated
    monkeypatch.setattr(progress, "PLAIN_INTERVAL", 0.0)
    assert cli.main(["verify", url, "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["ok"] and [r["checkpoint"] for r in doc["reports"]] == ids
    assert set(doc["reports"][0]) == {"checkpoint", "ok", "chain", "chunks_checked", "bytes_checked", "problems"}
    assert "verify: " in err


@pytest.mark.parametrize("command", ["compact", "copy"])
def test_compact_and_copy_show_plain_progress_off_a_terminal(
    command: str,
    populated: tuple[str, list[str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url, _ = populated
    monkeypatch.setattr(progress, "PLAIN_INTERVAL", 0.0)
    args = {"compact": [url], "copy": [url, "--step", "30", str(tmp_path / "dest")]}[command]
    assert cli.main([command, *args]) == 0
    err = capsys.readouterr().err.splitlines()
    line = re.compile(rf"^{command}: \S+ \S+ of \S+ \S+ \(\d+%\), \S+ \S+/s, ETA \S+$")
    assert err and all(line.match(x) for x in err[:-1]) and err[-1].startswith(f"{command}: done, "), err
    assert cli.main([command, *args, "--quiet"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("command", ["verify", "compact", "copy"])
def test_progress_on_a_terminal_does_not_get_in_the_way(
    command: str, populated: tuple[str, list[str]], tmp_path: Path
) -> None:
    url, _ = populated
    args = {"verify": [url], "compact": [url], "copy": [url, "--step", "30", str(tmp_path / "dest")]}[command]
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    chunks: list[bytes] = []
    try:
        with subprocess.Popen(
            [sys.executable, "-m", "psguard.cli", command, *args], stdout=subprocess.PIPE, stderr=slave, text=True
        ) as proc:
            os.close(slave)
            slave = -1
            while True:  # drain the terminal while the command runs: what it held is gone once the command exits
                ready, _, _ = select.select([master], [], [], 0.05)
                if ready:
                    try:
                        chunks.append(os.read(master, 65536))
                    except OSError:  # EIO: the command closed its side
                        break
                elif proc.poll() is not None:
                    break
            stdout = proc.stdout.read() if proc.stdout else ""
            proc.wait(timeout=120)
    finally:
        os.close(master)
        if slave != -1:
            os.close(slave)
    err = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert {"verify": ": ok", "compact": "compacted", "copy": "copied to"}[command] in stdout
    assert f"{command}:" in err and "B/s" in err  # tqdm's bar: name, bytes, rate


# ------------------------------------------------------------------------------------------------ verify reads once
class CountingBackend(MeteredBackend):
    """Counts the bytes of chunks read (manifests aside)."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner, lambda n: None)
        self.chunk_bytes_read = 0

    def get_into(self, key: str, out: memoryview) -> int:
        size = self.inner.get_into(key, out)
        if key.startswith(CHUNK_PREFIX):
            self.chunk_bytes_read += min(size, len(out))
        return size

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        if key.startswith(CHUNK_PREFIX):
            self.chunk_bytes_read += len(data)
        return data


def test_verify_reads_each_chunk_once_however_many_chains_share_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "store")
    t = np.arange(40000, dtype=np.float32).reshape(10000, 4)
    with Store.open(url, chunk_bytes=8192) as s:
        ids = [s.save(0, {"emb": t.copy()}).id]
        for step in range(1, 11):  # 1 base + 10 deltas, each over the previous one
            t[step * 7] = -step
            upd = {"emb": Rows(np.array([step * 7]), t[step * 7 : step * 7 + 1], t.shape)}
            ids.append(s.save(step, upd, parent=ids[-1]).id)
    stored = sum(p.stat().st_size for p in (Path(url) / CHUNK_PREFIX).rglob("*") if p.is_file())
    opened: list[CountingBackend] = []
    open_backend = facade.open_backend

    def counting(*a: Any, **kw: Any) -> Backend:
        opened.append(CountingBackend(open_backend(*a, **kw)))
        return opened[-1]

    monkeypatch.setattr(facade, "open_backend", counting)
    with Store.open(url) as s:  # before: each checkpoint verified on its own, its whole chain read again
        assert all(s.verify(cid).ok for cid in ids)
    before = opened[-1].chunk_bytes_read
    assert cli.main(["verify", url, "--quiet"]) == 0
    after = opened[-1].chunk_bytes_read
    print(f"chunk bytes read by verify: before {before}, after {after}; stored {stored}")
    assert after <= stored < before / 5


# ------------------------------------------------------------------------------------------------ TensorFlow's C++ log
TF_CPP_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d|cpu_feature_guard|absl::InitializeLog|oneDNN custom operations")


@pytest.mark.slow
def test_export_keeps_tensorflow_cpp_logging_out_of_its_output(
    populated: tuple[str, list[str]], tmp_path: Path
) -> None:
    url, _ = populated
    env = {k: v for k, v in os.environ.items() if k not in cli.QUIET_TENSORFLOW}
    out = subprocess.run(
        [sys.executable, "-m", "psguard.cli", "export", url, str(tmp_path / "tf"), "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "tf" / "checkpoint").exists()
    assert not [line for line in out.stderr.splitlines() if TF_CPP_LINE.search(line)], out.stderr
    # -vv leaves TensorFlow's logging as the environment has it: the same command then shows its C++ lines
    loud = subprocess.run(
        [sys.executable, "-m", "psguard.cli", "-vv", "export", url, str(tmp_path / "tf2"), "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert loud.returncode == 0, loud.stderr
    assert [line for line in loud.stderr.splitlines() if TF_CPP_LINE.search(line)], loud.stderr


def test_quieting_tensorflow_leaves_what_the_user_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")
    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    cli.quiet_tensorflow(verbose=1)
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "1" and os.environ["TF_ENABLE_ONEDNN_OPTS"] == "0"
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL")
    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS")
    cli.quiet_tensorflow(verbose=2)
    assert "TF_CPP_MIN_LOG_LEVEL" not in os.environ and "TF_ENABLE_ONEDNN_OPTS" not in os.environ
