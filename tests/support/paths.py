"""Where the repository is, and the environment a child process that may load TensorFlow runs with."""

from __future__ import annotations

from pathlib import Path

#: The repository's root (tests/support/paths.py -> tests/support -> tests -> root), whatever folder a test is in.
ROOT = Path(__file__).resolve().parents[2]
#: TensorFlow quiet in child processes: no C++ log lines, no oneDNN notice.
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "0"}
