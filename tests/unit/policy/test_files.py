"""Policy files: the presets, validation errors that name file, key and expectation, and hot reload."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest

from psguard.errors import ConfigError
from psguard.handoff.contract import Tier
from psguard.policy.engine import (
    AnyOf,
    ChainLimit,
    Continuous,
    Cron,
    EveryInterval,
    EverySteps,
    SaveContext,
    TierState,
    YoungDaly,
)
from psguard.policy.files import PRESETS_DIR, PolicySpec, PolicyWatcher, Reload, load_policy, preset_names

PRESETS = ["aggressive-memory", "default", "recsys-hourly", "spot-preemptible", "young-daly"]
T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z


def test_the_presets_are_all_there() -> None:
    assert preset_names() == PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads_and_is_commented(name: str) -> None:
    path = PRESETS_DIR / f"{name}.yaml"
    spec = load_policy(path)
    assert spec == load_policy(name)  # by preset name too
    assert spec.description
    text = path.read_text()
    assert text.startswith("#") and "For:" in text  # says who it is for
    schedule = spec.schedule
    assert schedule.memory is not None or schedule.durable is not None
    summary = spec.summary()
    assert set(summary) == {"memory", "durable", "base", "preemption", "retention", "hang", "durable_lag"}
    # It decides: overdue everything -> saves.
    d = schedule.decide(10**6, T0 + 30 * 86400, SaveContext(started_at=T0, observed_since=T0))
    assert Tier.MEMORY in d.tiers


def test_default_preset_means_what_it_says() -> None:
    spec = load_policy("default")
    s = spec.schedule
    assert s.memory == EveryInterval(30.0)
    assert s.durable == EveryInterval(600.0)
    assert s.base == AnyOf((EveryInterval(3600.0), ChainLimit(max_chain=50, max_delta_percent=100.0)))
    assert s.on_preemption == {Tier.MEMORY}
    assert spec.preemption.grace == 20.0
    assert spec.retention.keep_last == 5 and spec.retention.keep_every_hours == 24


def test_tier_rules_compose() -> None:
    spec = load_policy("aggressive-memory")
    assert spec.schedule.memory == AnyOf((EveryInterval(5.0), EverySteps(500)))
    assert spec.schedule.durable == Continuous(min_interval=120.0)
    recsys = load_policy("recsys-hourly")
    assert recsys.schedule.durable == Cron("0 * * * *")
    assert recsys.retention.metric == "auc" and recsys.retention.mode == "max"
    spot = load_policy("spot-preemptible")
    assert spot.schedule.on_preemption == {Tier.MEMORY, Tier.DURABLE}
    assert isinstance(spot.schedule.durable, AnyOf)
    assert any(isinstance(p, YoungDaly) for p in spot.schedule.durable.policies)


@pytest.mark.parametrize(
    ("text", "where", "expected"),
    [
        ("memory: {every: 30s}\ndurabel: {every: 10m}\n", "durabel: unknown key", "did you mean 'durable'"),
        ("memory: {every: -30s}\n", "memory.every:", "a duration such as"),
        ("memory: {every: 0s}\n", "memory.every:", "(> 0)"),
        ("memory: {every_steps: 0}\n", "memory.every_steps:", "(>= 1)"),
        ("memory: {every_steps: ten}\n", "memory.every_steps:", "an integer"),
        ("durable: {cron: '0 25 * * *'}\n", "durable.cron:", "a cron expression"),
        ("durable: {cron: '0 0 31 2 *'}\n", "durable.cron:", "matches none in 400 years"),
        ("durable: {cron: '0 0 30 2 *'}\n", "durable.cron:", "matches none in 400 years"),
        ("memory: {every: 30s}\nbase: {cron: '0 0 31 4 *'}\n", "base.cron:", "matches none in 400 years"),
        ("durable: {every: 1000000000000}\n", "durable.every:", "a longer cadence never fires"),
        ("durable: {every: .inf}\n", "durable.every:", "a duration such as"),
        ("durable: {every: .nan}\n", "durable.every:", "a duration such as"),
        ("durable: {every_steps: -3}\n", "durable.every_steps:", "(>= 1)"),
        ("durable: {continuous: {min_interval: 1000000000000}}\n", "min_interval:", "never fires"),
        ("durable: {young_daly: {stall_prior: 1s}}\n", "durable.young_daly.mtbf_prior:", "missing required key"),
        (
            "durable: {young_daly: {mtbf_prior: 6h, min_interval: 1h, max_interval: 10m}}\n",
            "durable.young_daly.max_interval:",
            ">= min_interval",
        ),
        ("memory: {every: 30s}\nretention: {keep_last: 0}\n", "retention.keep_last:", "keeps something"),
        ("memory: {every: 30s}\nretention: {keep_best: 3}\n", "retention.metric:", "name of a reported metric"),
        ("memory: {every: 30s}\nretention: {keep_best: 1, metric: auc, mode: up}\n", "retention.mode:", "'min'"),
        ("memory: {every: 30s}\npreemption: {tiers: [disk]}\n", "preemption.tiers[0]:", "'memory', 'durable'"),
        ("memory: {every: 30s}\npreemption: {grace: 0s}\n", "preemption.grace:", "(> 0)"),
        ("memory: {every: 30s}\nbase: {max_delta_percent: -5}\n", "base.max_delta_percent:", "a percentage > 0"),
        ("description: nothing\n", "durable:", "this policy never saves"),
        ("memory: {every: 30s}\nmemory: {every: 1m}\n", "not valid YAML", "given twice"),
        ("memory: {every: 30s}\nhang: [1\n", "line 3 column 1: not valid YAML", "expected ',' or ']'"),
        ("memory: every 30s\n", "memory:", "a mapping of TierSpec settings"),
    ],
)
def test_invalid_policy_files_name_file_key_and_expectation(
    tmp_path: Path, text: str, where: str, expected: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_policy(path)
    message = str(err.value)
    assert message.startswith(str(path)), message
    assert where in message and expected in message, message


def test_load_policy_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_policy(tmp_path / "absent.yaml")


# ------------------------------------------------------------------------------------------- hot reload
class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def wait_outcome(watcher: PolicyWatcher, outcome: str, since: int, timeout: float = 10.0) -> Reload:
    """Wait until a change after generation ``since`` ends with ``outcome`` (an editor's write can be seen
    half-done first: that is reported, then superseded)."""
    deadline = time.monotonic() + timeout
    generation = since + 1
    while (left := deadline - time.monotonic()) > 0:
        result = watcher.wait_for(generation, left)
        if result is None:
            break
        if result.outcome == outcome and watcher.generation == result.generation:
            return result
        generation = watcher.generation + 1
    raise AssertionError(f"no {outcome!r} reload within {timeout}s; last: {watcher.last_reload}")


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    path = tmp_path / "policy.yaml"
    shutil.copy(PRESETS_DIR / "default.yaml", path)
    return path


def replace(path: Path, text: str) -> None:
    """Write ``text`` as a new file and rename it over ``path``: how a policy file is edited."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_valid_edit_takes_effect_at_the_next_decision_and_is_logged(
    policy_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock(T0 + 301)
    ctx = SaveContext(started_at=T0, memory=TierState(1, T0 + 300))
    seen: list[Reload] = []
    with PolicyWatcher(policy_file, clock=clock, on_reload=seen.append, settle=0.1) as watcher:
        assert not watcher.decide(10, ctx)  # durable every 10m: not yet at 301 s
        g = watcher.generation
        caplog.set_level(logging.INFO, logger="psguard.policy.files")
        replace(policy_file, policy_file.read_text().replace("every: 10m", "every: 5m"))
        result = wait_outcome(watcher, "applied", g)
        assert result.changes == ("durable.every: 600.0 -> 300.0",)
        decision = watcher.decide(11, ctx)
        assert decision.tiers == {Tier.MEMORY, Tier.DURABLE} and "durable: every 5m" in decision.reason
        assert watcher.last_decision == decision
        assert watcher.status()["last_reload"] == {"outcome": "applied", "error": None}
    assert any("event=policy_reloaded" in r.message and "durable.every" in r.message for r in caplog.records)
    assert any("event=save_decision" in r.message for r in caplog.records)
    assert [r.outcome for r in seen] == ["applied"]  # read once, after the write settled


def test_invalid_edit_keeps_the_old_policy_and_reports(policy_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    with PolicyWatcher(policy_file, settle=0.05) as watcher:
        before = watcher.spec
        g = watcher.generation
        replace(policy_file, policy_file.read_text().replace("every: 10m", "every: -10m"))
        result = wait_outcome(watcher, "rejected", g)
        assert result.error is not None
        assert str(policy_file) in result.error and "durable.every" in result.error
        assert "a duration such as" in result.error
        assert watcher.spec is before
        assert watcher.decide(1, SaveContext(started_at=T0), now=T0 + 601).tiers == {Tier.MEMORY, Tier.DURABLE}
        # Fixing the file applies it.
        g = watcher.generation
        replace(policy_file, policy_file.read_text().replace("every: -10m", "every: 20m"))
        assert wait_outcome(watcher, "applied", g).changes == ("durable.every: 600.0 -> 1200.0",)
    assert any("event=policy_rejected" in r.message for r in caplog.records if r.levelno == logging.ERROR)


def test_deleted_file_keeps_the_old_policy(policy_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    with PolicyWatcher(policy_file, settle=0.05) as watcher:
        before = watcher.spec
        g = watcher.generation
        policy_file.unlink()
        result = wait_outcome(watcher, "deleted", g)
        assert result.error is not None and "keeping the policy in effect" in result.error
        assert watcher.spec is before
        assert watcher.decide(1, SaveContext(started_at=T0), now=T0 + 31)  # still deciding, old policy
        # Put back with an edit: applied.
        g = watcher.generation
        replace(policy_file, (PRESETS_DIR / "default.yaml").read_text().replace("every: 30s", "every: 15s"))
        assert wait_outcome(watcher, "applied", g).changes == ("memory.every: 30.0 -> 15.0",)
    assert any("event=policy_file_deleted" in r.message for r in caplog.records)


def test_without_watchdog_the_file_is_polled(policy_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("watchdog", "watchdog.events", "watchdog.observers"):  # as where the extra is not installed
        monkeypatch.setitem(sys.modules, name, None)
    with PolicyWatcher(policy_file, settle=0.05, poll=0.05) as watcher:
        assert watcher.polling
        g = watcher.generation
        replace(policy_file, policy_file.read_text().replace("every: 10m", "every: 5m"))
        assert wait_outcome(watcher, "applied", g).changes == ("durable.every: 600.0 -> 300.0",)


def test_watcher_needs_a_valid_file_to_start(tmp_path: Path) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text("memory: {every: soon}\n")
    with pytest.raises(ConfigError, match=r"memory\.every"):
        PolicyWatcher(bad)


def test_reload_without_observer_and_unchanged_bytes(policy_file: Path) -> None:
    watcher = PolicyWatcher(policy_file)
    assert watcher.reload() is None  # same bytes: nothing to do
    replace(policy_file, policy_file.read_text() + "\n# a comment only\n")
    result = watcher.reload()
    assert result is not None and result.outcome == "unchanged" and result.generation == 1
    assert isinstance(watcher.spec, PolicySpec)


# ------------------------------------------------------------------------------- files that are not policies
SECRET = "hunter2-s3cr3t"
NOT_POLICIES = {
    "passwd": f"root:x:0:0:{SECRET}:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n",
    "a line": f"{SECRET} is the token\n",
    "a list": f"- {SECRET}\n- two\n",
    "broken flow": f'{{"password": "{SECRET}"\n',
    "a tag": f"!{SECRET} value\n",
    "a tag handle": f"!{SECRET}! value\n",
    "a bad escape": f'"{SECRET}\\q"\n',
    "ini": f"[default]\naws_secret_access_key = {SECRET}\n",
    "a key's value": f"memory: {SECRET}\nusername: admin\n",
    "a mapping of other things": f"password: {SECRET}\n",
}


@pytest.mark.parametrize("text", NOT_POLICIES.values(), ids=NOT_POLICIES.keys())
def test_a_file_that_is_not_a_policy_is_never_quoted(tmp_path: Path, text: str) -> None:
    """A policy path may be a symlink to any file the process can read (a password file): the error names the
    path and what is wrong, never what the file holds."""
    target = tmp_path / "secret.txt"
    target.write_text(text)
    link = tmp_path / "policy.yaml"
    link.symlink_to(target)
    with pytest.raises(ConfigError) as err:
        load_policy(link)
    message = str(err.value)
    assert message.startswith(f"{link}: "), message
    assert SECRET not in message and SECRET[:6] not in message, message


def test_a_symlink_swapped_to_a_file_that_is_not_a_policy_is_refused_unquoted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = tmp_path / "v1.yaml"
    shutil.copy(PRESETS_DIR / "default.yaml", good)
    secret = tmp_path / "passwd"
    secret.write_text(NOT_POLICIES["passwd"])
    link = tmp_path / "policy.yaml"
    link.symlink_to(good)
    caplog.set_level(logging.INFO, logger="psguard.policy.files")
    with PolicyWatcher(link, settle=0.05) as watcher:
        before, g = watcher.spec, watcher.generation
        swap = tmp_path / ".policy.yaml.new"
        swap.symlink_to(secret)
        os.replace(swap, link)  # as a ConfigMap update swaps its link
        result = wait_outcome(watcher, "rejected", g)
        assert result.error is not None and result.error.startswith(f"{link}: (top level): expected a mapping")
        assert SECRET not in result.error
        assert watcher.spec is before
    assert any(r.levelno == logging.ERROR and "event=policy_rejected" in r.getMessage() for r in caplog.records)
    assert SECRET not in caplog.text


def test_a_cron_that_never_fires_is_refused_under_hot_reload(policy_file: Path) -> None:
    with PolicyWatcher(policy_file, settle=0.05) as watcher:
        before, g = watcher.spec, watcher.generation
        replace(policy_file, policy_file.read_text().replace("every: 10m", 'cron: "0 0 31 2 *"'))
        result = wait_outcome(watcher, "rejected", g)
        assert result.error is not None and "durable.cron" in result.error and "matches none" in result.error
        assert watcher.spec is before and watcher.spec.durable.every == 600.0


# ------------------------------------------------------------------------------------- half-written files
class Seen:
    """The watcher's outcomes as they come, each with the policy in effect right after it."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.outcomes: list[tuple[Reload, PolicySpec]] = []
        self.watcher: PolicyWatcher | None = None

    def __call__(self, result: Reload) -> None:
        assert self.watcher is not None
        with self.cond:
            self.outcomes.append((result, self.watcher.spec))
            self.cond.notify_all()

    def wait_digest(self, data: bytes, timeout: float = 10.0) -> Reload:
        """The outcome of the watcher's look at exactly these bytes."""
        digest = hashlib.sha256(data).hexdigest()
        with self.cond:
            assert self.cond.wait_for(lambda: any(r.digest == digest for r, _ in self.outcomes), timeout), (
                f"the watcher never looked at these bytes: {[r for r, _ in self.outcomes]}"
            )
            return next(r for r, _ in self.outcomes if r.digest == digest)


def test_a_policy_written_in_two_steps_is_never_applied_half_written(policy_file: Path) -> None:
    """The first half alone is valid (a memory cadence) and would turn the durable tier off: the watcher sees
    it, and must not apply it; nor the whole, written in place; a rename of the whole applies it."""
    first = b"memory: {every: 30s}\n"
    second = b"durable: {every: 5m}\n"
    seen = Seen()
    with PolicyWatcher(policy_file, on_reload=seen, settle=0.05) as watcher:
        seen.watcher = watcher
        assert watcher.spec.durable.every == 600.0
        with open(policy_file, "wb") as f:  # in place: truncate, then the first half
            f.write(first)
        half = seen.wait_digest(first)
        assert half.outcome == "rejected" and half.error is not None and "rewritten in place" in half.error
        assert watcher.spec.durable.every == 600.0  # the durable tier stays on
        with open(policy_file, "ab") as f:  # the second half
            f.write(second)
        whole = seen.wait_digest(first + second)
        assert whole.outcome == "rejected" and watcher.spec.durable.every == 600.0
        replace(policy_file, (first + second).decode())
        done = wait_outcome(watcher, "applied", whole.generation)
        assert "durable.every: 600.0 -> 300.0" in done.changes
    applied = [spec for r, spec in seen.outcomes if r.outcome == "applied"]
    assert applied and all(spec.durable.every is not None for spec in applied)


def test_a_file_put_back_after_deletion_is_applied(policy_file: Path) -> None:
    """The inode of the file last looked at stays held: a file renamed in after a deletion is a new file even
    where the file system would have reused the number."""
    seen = Seen()
    with PolicyWatcher(policy_file, on_reload=seen, settle=0.05) as watcher:
        seen.watcher = watcher
        g = watcher.generation
        policy_file.unlink()
        wait_outcome(watcher, "deleted", g)
        text = (PRESETS_DIR / "default.yaml").read_text().replace("every: 10m", "every: 7m")
        replace(policy_file, text)
        assert seen.wait_digest(text.encode()).outcome == "applied"
        assert watcher.spec.durable.every == 420.0


# ---------------------------------------------------------------------------------------- not regular files
def test_a_fifo_or_device_swapped_in_under_hot_reload_is_refused_without_blocking(policy_file: Path) -> None:
    with PolicyWatcher(policy_file, settle=0.05) as watcher:
        before, g = watcher.spec, watcher.generation
        fifo = policy_file.with_name(".fifo")
        os.mkfifo(fifo)
        os.replace(fifo, policy_file)
        result = wait_outcome(watcher, "rejected", g)
        assert result.error is not None and "not a regular file" in result.error
        g = watcher.generation
        device = policy_file.with_name(".zero")
        device.symlink_to("/dev/zero")
        os.replace(device, policy_file)
        result = wait_outcome(watcher, "rejected", g)
        assert result.error is not None and "not a regular file" in result.error
        assert watcher.spec is before
        g = watcher.generation  # and watching goes on
        replace(policy_file, (PRESETS_DIR / "default.yaml").read_text().replace("every: 10m", "every: 5m"))
        assert wait_outcome(watcher, "applied", g).changes == ("durable.every: 600.0 -> 300.0",)
