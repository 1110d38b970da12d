"""What the trainer and its agent agree on, besides the spool's file format (:mod:`psguard.handoff.spool`).

Both sides import these names; neither defines its own copy. Changing a value here changes the protocol
between two processes that may run different psguard versions during a rolling upgrade: add, never rename.
"""

from __future__ import annotations

import enum
import os
import re
import signal
from pathlib import Path

from psguard.errors import ConfigError


class Tier(enum.StrEnum):
    """Where a save goes. ``BASE`` means: make the durable chain start afresh from a full base."""

    MEMORY = "memory"
    DURABLE = "durable"
    BASE = "base"


# ------------------------------------------------------------------------------------------------ environment
#: The spool folder the agent serves, set for the trainer it runs.
ENV_SPOOL = "PSGUARD_SPOOL"
#: The URL of the durable log the agent writes (its ``--store``), set beside ``ENV_SPOOL``; empty when it has
#: none. A trainer's manager compares it with its own directory (absent: an agent too old to say).
ENV_STORE = "PSGUARD_STORE"
#: The agent's HTTP base URL, set for its task.
ENV_AGENT_URL = "PSGUARD_AGENT_URL"
#: The path of the agent's bearer-token file (never the token itself), when it has one.
ENV_AGENT_TOKEN_FILE = "PSGUARD_AGENT_TOKEN_FILE"
#: With HTTPS: the CA file that signed the agent's certificate (the trainer verifies its agent against it).
ENV_AGENT_CA = "PSGUARD_AGENT_CA"
#: With mutual TLS: the client certificate and its key file the trainer presents to its agent.
ENV_AGENT_CLIENT_CERT = "PSGUARD_AGENT_CLIENT_CERT"
ENV_AGENT_CLIENT_KEY = "PSGUARD_AGENT_CLIENT_KEY"
#: TensorFlow's C++ logger prints INFO and WARNING lines (CPU features, oneDNN) on stderr when it loads; the tasks
#: psguard starts and its own commands set these unless the user did (the logger reads them once, at load).
QUIET_TENSORFLOW = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "0"}
#: ``full``: the built-in server (:mod:`psguard.agent.process.tf_server`) starts through ``import tensorflow``
#: instead of loading only TF's runtime (1 s against 9-10 s of CPU).
ENV_SERVER_IMPORT = "PSGUARD_SERVER_IMPORT"
#: The environment of servers that stand for a plain-TF job's (the baselines): its PS scripts import tensorflow.
PLAIN_TF_SERVERS = {ENV_SERVER_IMPORT: "full"}
#: ``role:index`` of the task the agent runs (``ps:0``).
ENV_TASK = "PSGUARD_TASK"
#: Set by the chief's agent for its trainer when the PS run under agents that keep their shards: JSON
#: ``{"ps:0": "<that PS agent's part folder on its node>", ...}`` (:mod:`psguard.handoff.parts`). The trainer
#: then captures and restores those shards on the PS nodes.
ENV_PARTS = "PSGUARD_PARTS"

# ------------------------------------------------------------------------------------------------ exit codes
EXIT_OK = 0
"""The task finished: the supervisor does not restart it and is done."""

EXIT_RESTART = 75
"""``EX_TEMPFAIL`` from ``sysexits.h``: restart me now, this is not a crash (the trainer after a PS failure)."""

#: The signal on which a trainer under an agent writes every thread's Python stack to stderr (faulthandler):
#: the agent sends it to a hung trainer before restarting it, so the task log says where it was stuck.
HANG_DUMP_SIGNAL = signal.SIGUSR1

# ------------------------------------------------------------------------------------------------ metadata keys
#: Metadata key under which a durable checkpoint records the memory-tier token of its state, so a tier
#: re-seeded from it (or a trainer restored from it) can accept deltas relative to that state.
TOKEN_KEY = "psguard.token"

#: Metadata key under which a trainer's CheckpointManager asks for its retention (``max_to_keep``,
#: ``keep_checkpoint_every_n_hours``) when the agent writes the durable log for it: the writer applies it
#: after each commit, as the manager does when it writes itself.
RETENTION_KEY = "psguard.store.retention"

#: Metadata key under which a trainer's CheckpointManager passes its ``new_base_after`` (when the user set it) to
#: the agent that writes the durable log for it: ``{"max_chain": N}``, which replaces the agent's own ``max_chain``
#: (``0``: never a new base by chain length). One rule, one setting, whichever process writes.
NEW_BASE_KEY = "psguard.store.new_base"

#: Metadata key of a capture: the training stall it cost in seconds (the agent's stall histogram).
STALL_KEY = "capture_stall_seconds"


def default_spool_dir(job: str) -> Path:
    """``/dev/shm/psguard-<job>`` (tmpfs), or the temp folder where there is no ``/dev/shm``: where the trainer
    and its agent meet when neither is told (here, beside the other names both read, and light: every agent's
    start computes it before it starts its task, and it once imported the spool, numpy and the store for it)."""
    if not re.match(r"^[A-Za-z0-9_.-]+$", job):
        raise ConfigError(f"job name {job!r} must be made of [A-Za-z0-9_.-] to name a spool folder")
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    return base / f"psguard-{job}"
