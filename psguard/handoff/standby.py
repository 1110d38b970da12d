"""The standby protocol, both sides of it: how a process started ahead of need learns it may go.

A standby sees ``PSGUARD_STANDBY=1`` in its environment, creates the file named by ``PSGUARD_STANDBY_READY``
once it has done its preparation (imported TensorFlow), and reads one line from stdin: ``go`` means start now,
end of file (or anything else) means it is not wanted and exits 0. The spawner's side is
:class:`psguard.agent.process.standby.Standby`; the built-in TF server (:mod:`psguard.agent.process.tf_server`)
and the warm trainer (:mod:`psguard.trainer.warm`, which then reads one more line: the environment to run
with) are the processes that honour it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

STANDBY_ENV = "PSGUARD_STANDBY"
READY_ENV = "PSGUARD_STANDBY_READY"
GO = b"go\n"


def is_standby(environ: Mapping[str, str] | None = None) -> bool:
    """True in a process started as a standby (it must call :func:`wait_for_go` before binding anything)."""
    return (os.environ if environ is None else environ).get(STANDBY_ENV) == "1"


def wait_for_go(stream: BinaryIO | None = None) -> bool:
    """Block until the spawner says go (True) or drops us (False: end of file, or anything but ``go``)."""
    stream = stream if stream is not None else sys.stdin.buffer
    ready = os.environ.get(READY_ENV)
    if ready:
        with contextlib.suppress(OSError):  # only a signal to the spawner: failing to give it is no reason to fail
            Path(ready).touch()
    line = stream.readline()
    return line == GO
