"""``psguard wrap -- python train.py``: run an existing PS training script with every task under an agent.

What it starts: docs/user-guide.md ("An existing script"). The chief's agent watches every other agent; a PS or
worker agent that dies (a lost node) is started again, up to ``--agent-restarts`` times; each task counts as its
own node (``PSGUARD_NODE=wrap-ps0``...), so that peer copies land on another task's agent.

Exit code: 0 when the command finished; 1 when the chief's agent gave up on it or an agent died too often; 130 /
143 when interrupted (SIGINT / SIGTERM), after every process ``wrap`` started was stopped: the chief's agent
first (it drains the durable log), then the others. A second Ctrl-C or SIGTERM during that kills them at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from psguard.agent.config import AgentConfig
from psguard.agent.process.launcher import AgentProcess, LaunchError, write_cluster
from psguard.config import loads_yaml, read_settings_file
from psguard.errors import ConfigError, PsguardError
from psguard.handoff.credentials import create_token_file, read_secret_file
from psguard.run_folder import drop_memory_folders, memory_folder
from psguard.storage.registry import split_url

#: The chief's agent settings when ``--config`` is not given: a local cluster, so short probe intervals and
#: backoffs; three crashes within five minutes end the run (a script with a bug should not loop for long).
CHIEF_CONFIG = """\
probe: {interval: 0.5, deadline: 1.0, failure_threshold: 3, startup_timeout: 180}
supervisor: {backoff_initial: 0.5, backoff_max: 5, crash_loop_limit: 3, crash_loop_window: 300, stop_timeout: 30}
peers: {ready_timeout: 180, probe: {interval: 1.0, deadline: 1.0}}
persister: {retry_after: 1}
"""

NO_STORE_WARNING = (
    "psguard wrap: WARNING: no --store. The chief's agent keeps no durable log: a script using "
    "psguard.CheckpointManager writes its checkpoints itself to the URL it gives the manager, without the "
    "agent's memory tier, and a script that keeps tf.train.CheckpointManager is not checkpointed by psguard "
    "at all. Fix: psguard wrap --store URL (the URL the script gives psguard.CheckpointManager) -- ..."
)

_POLL = 0.1  # seconds between looks at the agents' processes (nothing to await: they are other processes)


class WrapError(PsguardError):
    """An agent of the wrapped job could not start or died; the message carries its log's tail."""


class _Stop(BaseException):
    """SIGTERM: unwind through the ``finally`` blocks that stop every agent, as Ctrl-C does."""


def _stop_all(chief: AgentProcess | None, servers: Sequence[AgentProcess]) -> None:
    """Stop the chief's agent (it stops the trainer and drains the durable log), then every server agent.

    A second Ctrl-C or SIGTERM while this runs does not abandon the agents (they run in their own sessions and
    would outlive wrap): it cuts the waiting short and kills them instead.
    """
    hurry = threading.Event()
    previous: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError):  # not the main thread: no second signal to handle
            previous[sig] = signal.signal(sig, lambda *_: hurry.set())
    try:
        if chief is not None:
            chief.stop(180.0, hurry)  # the agent's persister.drain_timeout is 120 s by default
        for agent in servers:  # all at once: each agent takes a second or two to stop its server
            if agent.proc.poll() is None:
                agent.proc.send_signal(signal.SIGTERM)
        for agent in servers:
            agent.stop(60.0, hurry)  # and closes its log
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run(command: Sequence[str], args: argparse.Namespace) -> int:
    """Run ``command`` as the chief of a local PS cluster, every task under an agent (``args``: ``psguard wrap``'s
    options); its exit code (see above).

    Blocks until the command finished or the chief's agent gave up; every process started here is stopped
    before this returns, also on ``KeyboardInterrupt``. ``--token-file``: the agents' bearer token (kept), so
    that the run can be queried; by default a fresh one, removed at the end.
    """
    chief_settings = _checked(command, args)
    ps, workers, store = args.ps, args.workers, args.store
    own_dir = args.dir is None
    work = Path(tempfile.mkdtemp(prefix="psguard-wrap-")) if own_dir else Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    work = work.resolve()
    cluster, _ = write_cluster(work, ps=ps, workers=workers)
    spool = memory_folder(work, "spool", "psguard-wrap-")
    in_memory = [spool]  # the run's folders on tmpfs, removed at the end whatever happened
    agents_dir = work / "agents"
    servers: list[Any] = []
    chief: AgentProcess | None = None
    failed = True
    # One token per run for every agent (the chief's agent restarts the PS servers with it), in a private file
    # outside the work folder, which is kept on failure; one made here is removed when the run ends.
    token = create_token_file("psguard-wrap-token-") if args.token_file is None else None
    token_path = token.path if token is not None else Path(args.token_file).resolve()
    try:
        base = ["--cluster", str(cluster)]
        servers += _start_servers(work, base, ps, workers, store, token_path, in_memory)
        try:
            peers = [arg for agent in servers for arg in ("--peer", agent.wait_url(args.start_timeout))]
        except LaunchError as e:
            raise WrapError(str(e)) from None
        chief_args = ["--role", "chief", "--index", "0", *base, "--spool", str(spool), *peers]
        chief_args += ["--store", store] if store is not None else []
        # Its output on the terminal, and the user's environment for the trainer (their TensorFlow settings). Its
        # own session: Ctrl-C reaches wrap alone, which then stops the chief's agent with SIGTERM, so that the
        # agent stops the trainer and drains the durable log before the servers go.
        config = CHIEF_CONFIG if chief_settings is None else json.dumps(chief_settings)
        v = getattr(args, "verbose", 0)
        chief = AgentProcess(
            agents_dir, "chief", chief_args, command, env=os.environ, config=config, token_file=token_path, terminal=v
        )
        while (code := chief.proc.poll()) is None:  # a PS or worker agent that dies meanwhile is replaced
            for agent in servers:
                if agent.proc.poll() is not None:
                    _replace(agent, args.agent_restarts)
            time.sleep(_POLL)
        failed = code != 0
        if failed:
            print(
                f"psguard wrap: the chief's agent exited {code}; logs of the other tasks: {agents_dir}", file=sys.stderr
            )
        return 0 if code == 0 else 1
    finally:
        _stop_all(chief, servers)
        if token is not None:
            token.remove()
        drop_memory_folders(in_memory)
        if own_dir and not failed:
            shutil.rmtree(work, ignore_errors=True)
        elif failed:
            print(f"psguard wrap: cluster.json and the agents' logs are in {work}", file=sys.stderr)


def _checked(command: Sequence[str], args: argparse.Namespace) -> dict[str, Any] | None:
    """Refuse bad options before any process starts; the user's ``--config`` settings (None: not given)."""
    if not command:
        raise ConfigError("give the training command after '--': psguard wrap [OPTIONS] -- python train.py ...")
    for flag, count, what in (("--ps", args.ps, "PS"), ("--workers", args.workers, "worker")):
        if count < 1:
            raise ConfigError(f"{flag}: a parameter-server job needs at least one {what}, got {count}")
    if args.agent_restarts < 0:
        raise ConfigError(f"--agent-restarts: expected 0 or more replacements per agent, got {args.agent_restarts}")
    chief_settings = None
    if args.config is not None:  # checked now: a bad key is refused before any process starts, naming the file
        if not Path(args.config).is_file():
            raise ConfigError(f"--config {args.config}: no such file")
        text = read_settings_file(str(args.config))
        loads_yaml(AgentConfig, text, source=str(args.config))
        chief_settings = yaml.safe_load(text) or {}
    if args.token_file is not None:
        read_secret_file(str(args.token_file), "--token-file")  # missing, empty, or readable by others: refused now
    if args.store is None:
        print(NO_STORE_WARNING, file=sys.stderr, flush=True)
    else:
        split_url(args.store)  # a URL missing a slash (s3:/bucket) fails here, before any process starts
    return chief_settings


def _start_servers(
    work: Path, base: list[str], ps: int, workers: int, store: str | None, token: Path, in_memory: list[Path]
) -> list[AgentProcess]:
    """Start the agent of every PS and worker; each PS's part folder (on tmpfs) is added to ``in_memory``."""
    servers = []
    for role, count in (("ps", ps), ("worker", workers)):
        for i in range(count):
            args = ["--role", role, "--index", str(i), *base]
            if role == "ps":  # each PS's agent keeps its shards (memory tier, its part of the log)
                in_memory.append(memory_folder(work, f"ps{i}-shards", "psguard-wrap-"))
                args += ["--spool", str(in_memory[-1]), *(["--store", store] if store else [])]
            node = {"PSGUARD_NODE": f"wrap-{role}{i}"}  # each task its own node: see the module docstring
            servers.append(AgentProcess(work / "agents", f"{role}{i}", args, env=node, token_file=token))
    return servers


def _replace(agent: AgentProcess, limit: int) -> None:
    """Start a dead PS or worker agent again, as a cluster manager replaces a lost pod; past ``limit``
    replacements the run fails with the agent's log."""
    replaced = agent.starts - 1
    if replaced >= limit:
        raise WrapError(
            f"the agent of {agent.name} exited {agent.proc.returncode} while the job ran, after {replaced} "
            f"replacement(s) (--agent-restarts {limit}; log {agent.log_path}):\n{agent.log_tail()}"
        )
    print(
        f"psguard wrap: the agent of {agent.name} exited {agent.proc.returncode} while the job ran; starting a "
        f"replacement ({replaced + 1} of at most {limit})",
        file=sys.stderr,
        flush=True,
    )
    agent.restart()


def main(args: argparse.Namespace) -> int:
    command = list(args.command or [])
    command = command[1:] if command[:1] == ["--"] else command

    def on_sigterm(*_: object) -> None:
        raise _Stop

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return run(command, args)
    except _Stop:
        print("psguard wrap: terminated; every process it started was stopped", file=sys.stderr, flush=True)
        return 143
    except KeyboardInterrupt:
        print("psguard wrap: interrupted; every process it started was stopped", file=sys.stderr, flush=True)
        return 130
    finally:
        with contextlib.suppress(ValueError, TypeError):
            signal.signal(signal.SIGTERM, previous)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "wrap",
        help="run an unmodified PS training script on a local cluster, every task under psguard agent",
        description=(
            "Write cluster.json on free loopback ports, start a psguard agent per PS and worker (each runs a "
            "tf.distribute.Server) and one for the chief that runs COMMAND with TF_CONFIG set; wait for COMMAND "
            "to finish, stop everything. Scripts switched to psguard.CheckpointManager (same URL as --store) "
            "also get the memory tier and the durable log."
        ),
    )
    p.add_argument("--ps", type=int, default=1, help="parameter servers (default 1)")
    p.add_argument("--workers", type=int, default=1, help="workers (default 1)")
    p.add_argument("--store", metavar="URL", help="durable log for psguard checkpoints: the URL the script uses")
    p.add_argument("--dir", help="cluster.json and agents' logs (default: a temporary folder, kept on failure)")
    p.add_argument(
        "--config",
        metavar="agent.yaml",
        help="settings of the chief's agent (default: see psguard.agent.wrap); its task records go under --dir "
        "unless the file sets state_dir",
    )
    p.add_argument("--start-timeout", type=float, default=180.0, help="seconds for each agent to serve (default 180)")
    p.add_argument(
        "--token-file",
        help="the agents' bearer token, in a file only you can read (to query them with psguard status while the "
        "job runs; default: a fresh token, removed at the end)",
    )
    p.add_argument(
        "--agent-restarts",
        type=int,
        default=3,
        metavar="N",
        help="replace a PS or worker agent that dies (with its task: a lost node) up to N times (default 3)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...: the training script and its arguments")
    p.set_defaults(func=main)
