"""The recorders (psguard.testbed.crash.recorder): every mutating call numbered, nothing else, the crash on time.

The file-system recorder installs an audit hook, which cannot be removed: its tests run it in a child process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from psguard.storage.memory import MemoryBackend, drop
from psguard.testbed.crash.recorder import CRASHED, CrashPlan, RecordingBackend
from tests.support.paths import ROOT


def child(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


_PLAN = """
import sys
from pathlib import Path
from psguard.testbed.crash.recorder import CrashPlan
plan = CrashPlan(int(sys.argv[1]), Path(sys.argv[2]))
plan.call("not counted: before the plan is active")
plan.active = True
for call in ("first", "second", "third"):
    plan.call(call)
    print("made", call, flush=True)
plan.finish()
print("finished", flush=True)
"""


def test_a_plan_kills_the_process_as_the_call_after_its_point_begins(tmp_path: Path) -> None:
    record = tmp_path / "crash.json"
    died = child(_PLAN, "2", str(record))
    assert died.returncode == CRASHED, died.stderr
    assert died.stdout.split("\n")[:-1] == ["made first", "made second"]
    assert json.loads(record.read_text()) == {"point": 2, "after": "second", "next": "third"}

    at_end = child(_PLAN, "3", str(record))
    assert at_end.returncode == CRASHED and "made third" in at_end.stdout and "finished" not in at_end.stdout
    assert json.loads(record.read_text())["next"] == "(the end of the run)"

    beyond = child(_PLAN, "4", str(tmp_path / "never.json"))
    assert beyond.returncode == 0 and "finished" in beyond.stdout and not (tmp_path / "never.json").exists()


def test_a_recording_backend_counts_each_mutating_request_and_names_the_calls_beneath_it(tmp_path: Path) -> None:
    plan = CrashPlan(None, tmp_path / "crash.json")
    plan.active = True
    inner = MemoryBackend("memory://recorded")
    try:
        backend = RecordingBackend(inner, plan, points=True)
        backend.put("a", b"1")
        backend.put_new("b", b"2")
        assert backend.get("a") == b"1" and backend.keys("") == ["a", "b"] and backend.exists("b")
        backend.delete("a")
        assert plan.calls == ["put a", "put_new b", "delete a"]

        named: list[str] = []
        quiet = RecordingBackend(_Naming(inner, plan, named), plan, points=False)
        quiet.put("c", b"3")
        assert plan.calls == ["put a", "put_new b", "delete a"], "a local store's requests are not the points"
        assert named == ["put c: fsync c.tmp"]
    finally:
        drop("recorded")


class _Naming(MemoryBackend):
    """A backend whose put reports the name a file-system call beneath it would get."""

    def __init__(self, inner: MemoryBackend, plan: CrashPlan, named: list[str]) -> None:
        super().__init__(inner.url)
        self.plan = plan
        self.named = named

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self.named.append(self.plan.named(f"fsync {key}.tmp"))
        super().put(key, data)


_FS = """
import json, os, sys
from pathlib import Path
from psguard.testbed.crash.recorder import CrashPlan, FsRecorder
base = Path(sys.argv[1])
root, outside = base / "root", base / "outside"
root.mkdir(); outside.mkdir(); (root / "exists").mkdir()
synced, unlinked = [], []
plan = CrashPlan(None, base / "crash.json")
FsRecorder(plan, [root], names=base, on_sync=lambda fd, p: synced.append(p), on_unlink=unlinked.append).install()
plan.active = True
os.mkdir(root / "d")
try:
    os.mkdir(root / "exists")
except FileExistsError:
    pass
fd = os.open(root / "d" / "f", os.O_WRONLY | os.O_CREAT, 0o644)
os.write(fd, b"data")
os.fsync(fd)
os.close(fd)
with open(root / "d" / "f", "rb") as f:
    f.read()
with open(root / "d" / "g", "w") as f:
    f.write("python file object")
os.replace(root / "d" / "g", root / "d" / "f")
os.link(root / "d" / "f", root / "d" / "h")
held = os.open(root / "d", os.O_RDONLY | os.O_DIRECTORY)
os.unlink(f"/proc/self/fd/{held}/h")
try:
    os.unlink(root / "d" / "missing")
except FileNotFoundError:
    pass
os.truncate(root / "d" / "f", 1)
(outside / "x").write_text("not watched")
os.rename(outside / "x", outside / "y")
os.fsync(held)
os.close(held)
plan.finish()
rel = lambda paths: [os.path.relpath(p, base) for p in paths]
print(json.dumps({"calls": plan.calls, "synced": rel(synced), "unlinked": rel(unlinked)}))
"""


def test_the_file_system_recorder_sees_every_mutating_call_under_its_roots_and_nothing_else(tmp_path: Path) -> None:
    ran = child(_FS, str(tmp_path))
    assert ran.returncode == 0, ran.stderr
    got = json.loads(ran.stdout)
    assert got["calls"] == [
        "mkdir root/d",
        "open root/d/f",
        "write root/d/f",
        "fsync root/d/f",
        "open root/d/g",  # a Python file object: its open, not its writes (no audit event for them)
        "rename root/d/g -> root/d/f",
        "link root/d/f -> root/d/h",
        "unlink root/d/h",  # reached through a descriptor held on its folder
        "truncate root/d/f",
        "fsync root/d",
    ]
    assert got["synced"] == ["root/d/f", "root/d"]  # what a page cache must hear of
    assert got["unlinked"] == ["root/d/f", "root/d/h"]  # the rename's target first
