"""The hand-off paths (psguard.testbed.crash.handoff_paths) run whole, and their checks find what they must.

Without a recorder (no crash point, so in pytest's own process): each path run to its end passes its check, and
one thing broken (a hand-off lost, an answer torn, an exported file damaged) is found.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from psguard.handoff.tensor_bundle import bundle_files, write_bundle
from psguard.testbed.crash import handoff_paths as paths
from psguard.testbed.crash.recorder import CrashPlan
from psguard.testbed.crash.session import History, Run, Session
from psguard.testbed.crash.store_paths import state


def run_whole(tmp_path: Path, workload: Any, setup: Any = None) -> tuple[Run, Any]:
    tmp_path.mkdir()
    run = Run(tmp_path, "", "tmpfs")
    context = setup(run) if setup is not None else None
    plan = CrashPlan(None, run.crash_record)
    session = Session(run, plan, roots=[])
    workload(session)
    plan.finish()
    session.history.close()
    return run, context


def test_the_spool_writers_hand_offs_all_reach_a_successor_and_one_lost_is_found(tmp_path: Path) -> None:
    run, _ = run_whole(tmp_path / "whole", paths.spool_writer)
    assert paths.check_spool_writer(run, None) == []

    run, _ = run_whole(tmp_path / "lost", paths.spool_writer)
    (paths.spool_root(run) / "incoming" / "000000000001").rename(paths.spool_root(run) / "elsewhere")
    problems = paths.check_spool_writer(run, None)
    assert any(p.startswith("capture seq 1 was handed off and not applied") for p in problems), problems


def test_the_spool_agents_answers_all_reach_its_trainer_and_a_torn_one_is_found(tmp_path: Path) -> None:
    run, trainer = run_whole(tmp_path / "whole", paths.spool_agent, paths.setup_spool_agent)
    assert paths.check_spool_agent(run, trainer) == []

    run, trainer = run_whole(tmp_path / "torn", paths.spool_agent, paths.setup_spool_agent)
    ack = paths.spool_root(run) / "acks" / "000000000000.json"
    ack.write_bytes(ack.read_bytes()[:10])
    problems = paths.check_spool_agent(run, trainer)
    assert any(p.startswith("the answer 000000000000.json does not read") for p in problems), problems


def test_the_tier_files_path_passes_its_check_and_an_exported_file_damaged_is_found(tmp_path: Path) -> None:
    run, _ = run_whole(tmp_path / "whole", paths.tier_files)
    assert paths.check_tier_files(run, None) == []

    (tmp_path / "damaged").mkdir()
    run = Run(tmp_path / "damaged", "", "tmpfs")
    prefix = tmp_path / "exported" / "0"
    prefix.parent.mkdir()
    write_bundle(prefix, state(run.seed, 1)["emb"])
    with History(run.history) as history:  # an export acknowledged, nothing asked after it
        history.append("invoke", "export", {"step": 1})
        history.append("ok", "export", {"status": "ok", "paths": [str(prefix)]})
    assert paths.check_tier_files(run, None) == []
    data = bundle_files(prefix)[1]
    blob = bytearray(data.read_bytes())
    blob[0] ^= 1
    data.write_bytes(bytes(blob))
    problems = paths.check_tier_files(run, None)
    assert any(p.startswith("the exported bundle 0 does not read") for p in problems), problems
