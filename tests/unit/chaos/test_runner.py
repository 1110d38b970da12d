"""The chaos run's storage (psguard.chaos.runner): a GCS store as the agents and the trainer reach it, through the
proxy where the nemesis puts the store's network faults, and an outage of its server."""

from __future__ import annotations

from pathlib import Path

import pytest

from psguard.chaos.runner import DEFAULT_JOB, _Run
from psguard.chaos.scenario import Scenario
from psguard.config import from_data
from psguard.errors import StorageUnavailableError
from psguard.storage import RetryConfig, open_backend

SHORT = RetryConfig(deadline=1.0, initial_backoff=0.05, max_backoff=0.2)


@pytest.mark.slow
def test_a_gcs_store_is_reached_through_the_proxy_the_nemesis_faults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = {
        "name": "t",
        "proves": "x",
        "storage": {"kind": "gcs"},
        "faults": [
            {"action": "storage-outage", "target": "store", "at_step": 10, "duration": 1},
            {"action": "drop", "target": "store", "at_step": 20, "duration": 1},
        ],
    }
    run = _Run(from_data(Scenario, doc, source="t.yaml"), tmp_path, seed=0, job=DEFAULT_JOB, faults=True, say=print)
    try:
        run.start_storage()
        proxy = run.proxies["store"]
        assert run.store_url == "gs://psguard-chaos/job"
        assert run.storage_env == {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{proxy.listen_port}"}
        for name, value in run.storage_env.items():  # what the agents and the trainer get: no storage options
            monkeypatch.setenv(name, value)
        backend = open_backend(run.store_url, retry=SHORT)
        backend.put("a", b"kept")
        proxy.set_mode("drop")  # the nemesis's network fault: connections reset and refused
        with pytest.raises(StorageUnavailableError):
            backend.get("a")
        proxy.set_mode("pass")
        assert backend.get("a") == b"kept"
        run.storage.stop(timeout=10)  # the nemesis's storage-outage, then its heal
        with pytest.raises(StorageUnavailableError):
            backend.get("a")
        run.storage.restart()
        assert backend.get("a") == b"kept"
        backend.close()
    finally:
        for p in run.proxies.values():
            p.close()
        run.stop_storage()
        run.history.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_store_errors_come_from_a_proxy_in_front_of_the_one_the_network_faults_use(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agents and the trainer reach an S3 or GCS store through the HTTP proxy that answers its errors
    (store-errors), which forwards through the TCP proxy where the store's network faults are (delay, drop)."""
    doc = {
        "name": "t",
        "proves": "x",
        "storage": {"kind": kind},
        "faults": [
            {"action": "store-errors", "target": "store", "at_step": 10, "duration": 1, "http_status": 500},
            {"action": "drop", "target": "store", "at_step": 20, "duration": 1},
        ],
    }
    run = _Run(from_data(Scenario, doc, source="t.yaml"), tmp_path, seed=0, job=DEFAULT_JOB, faults=True, say=print)
    try:
        run.start_storage()
        errors, network = run.store_errors, run.proxies["store"]
        variable = "AWS_ENDPOINT_URL" if kind == "s3" else "STORAGE_EMULATOR_HOST"
        assert run.storage_env[variable] == errors.endpoint_url
        for name, value in run.storage_env.items():
            monkeypatch.setenv(name, value)
        backend = open_backend(run.store_url, retry=SHORT)
        backend.put("a", b"kept")
        forwarded = errors.forwarded
        errors.fail_all(500)  # the nemesis's store-errors: every request answered 500, none forwarded
        with pytest.raises(StorageUnavailableError):
            backend.get("a")
        assert errors.failed >= 2 and errors.forwarded == forwarded  # retried, and every retry answered 500
        errors.heal()
        network.set_mode("drop")  # the error proxy's upstream is the network proxy
        with pytest.raises(StorageUnavailableError):
            backend.get("a")
        network.set_mode("pass")
        assert backend.get("a") == b"kept"
        backend.close()
    finally:
        for p in run.proxies.values():
            p.close()
        if run.store_errors is not None:
            run.store_errors.close()
        run.stop_storage()
        run.history.close()


def test_a_run_counts_and_kills_only_the_processes_it_started(tmp_path: Path) -> None:
    """CI: a chaos run inside a pytest worker that already ran the shared TF cluster counted that cluster's PS and
    worker as its own, reported them leaked and SIGKILLed them, and every later test of the lane met a dead PS.
    Processes alive before the run are not the run's."""
    import subprocess
    import sys

    doc = {"name": "t", "proves": "x", "faults": [{"action": "kill", "target": "ps:0", "at_step": 10}]}
    before = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        run = _Run(from_data(Scenario, doc, source="t.yaml"), tmp_path, seed=0, job=DEFAULT_JOB, faults=True,
                   say=print)  # fmt: skip
        mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        run.note_pids()
        assert mine.pid in run.pids_seen and before.pid not in run.pids_seen
        run.kill_leftovers()
        assert mine.wait(timeout=30) == -9
        assert before.poll() is None  # not the run's: left alone
    finally:
        before.kill()
        before.wait()
