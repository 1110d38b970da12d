"""``psguard demo --dir`` and ``psguard chaos run --report`` never delete a folder a psguard run did not make;
runs' folders on tmpfs (memory_folder) are fresh and dropped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from psguard import cli
from psguard.errors import ConfigError
from psguard.run_folder import MARKER, claim_folder
from tests.support.paths import ROOT


def test_a_new_or_empty_folder_is_taken_and_marked(tmp_path: Path) -> None:
    new = claim_folder(tmp_path / "a" / "b", "psguard demo")
    assert new == (tmp_path / "a" / "b").resolve() and [p.name for p in new.iterdir()] == [MARKER]
    assert json.loads((new / MARKER).read_text())["by"] == "psguard demo"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert [p.name for p in claim_folder(empty, "psguard demo").iterdir()] == [MARKER]


def test_a_folder_a_run_made_is_emptied_for_the_next_run(tmp_path: Path) -> None:
    folder = claim_folder(tmp_path / "run", "psguard chaos run")
    (folder / "history.jsonl").write_text("{}\n")
    (folder / "store").mkdir()
    again = claim_folder(folder, "psguard demo")
    assert [p.name for p in again.iterdir()] == [MARKER]


def test_someone_elses_folder_is_refused_and_left_alone(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('mine')\n")
    with pytest.raises(ConfigError, match=r"not empty and was not made by a psguard run .* will not delete it"):
        claim_folder(project, "psguard demo")
    assert [p.name for p in project.iterdir()] == ["train.py"]
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        claim_folder(project / "train.py", "psguard demo")


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--quick", "--dir"],
        ["chaos", "run", str(ROOT / "chaos" / "kill-ps.yaml"), "--report"],
    ],
    ids=["demo", "chaos"],
)
def test_the_commands_refuse_before_starting_anything(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("keep me\n")
    assert cli.main([*argv, str(project)]) == cli.EXIT_USAGE
    assert "was not made by a psguard run" in capsys.readouterr().err
    assert [p.name for p in project.iterdir()] == ["notes.txt"]


def test_the_quick_demo_reuses_its_own_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "demo"
    for _ in range(2):
        assert cli.main(["demo", "--quick", "--dir", str(folder), "--steps", "20", "--users", "2000"]) == 0
    assert (folder / MARKER).is_file() and (folder / "store").is_dir()


def test_a_memory_folder_is_fresh_private_and_on_tmpfs_then_dropped(tmp_path: Path) -> None:
    """PS part folders of ``psguard wrap`` and chaos runs: on /dev/shm (tier files need memory), one per call,
    owner-only; dropped at the end. Without a writable /dev/shm, ``work/<name>``, which is left alone."""
    from psguard.agent.tiers.tier_files import on_memory_fs
    from psguard.run_folder import drop_memory_folders, memory_folder

    a, b = (
        memory_folder(tmp_path, "ps0-shards", "psguard-test-"),
        memory_folder(tmp_path, "ps0-shards", "psguard-test-"),
    )
    try:
        assert a != b and a.parent == Path("/dev/shm") and a.name.startswith("psguard-test-ps0-shards-")
        assert on_memory_fs(a) and (a.stat().st_mode & 0o777) == 0o700
        (a / "tier").mkdir()
    finally:
        drop_memory_folders([a, b])
    assert not a.exists() and not b.exists()
    fallback = tmp_path / "ps1-shards"
    fallback.mkdir()
    drop_memory_folders([fallback])
    assert fallback.is_dir()
