"""One supervisor's process tree: what makes every process of its task die with the agent.

The task runs with a parent-death signal (:func:`pdeathsig_prefix`), which reaches only the direct child, so
every process of the task is also marked and killed by its mark (:mod:`psguard.agent.process.reaper`): at the end
of every run (:meth:`TaskTree.kill`), by a guard process the moment the agent dies, and by the next agent from
the record this one keeps (:meth:`TaskTree.settle_predecessor`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

from psguard.agent.process import reaper
from psguard.agent.process.lifecycle import SpawnError
from psguard.handoff.credentials import ensure_private_dir

log = logging.getLogger(__name__)

# Parent-death signal without ``preexec_fn`` (unsafe in a threaded process: the child may deadlock on a lock
# another thread held at fork). ``setpriv`` sets it and execs; the shell then checks that the parent is still
# the agent, because a parent that died between fork and prctl would never send the signal.
_PPID_GUARD = '[ "$PPID" = "$0" ] || exit 1; exec "$@"'


@functools.cache
def _setpriv() -> str | None:
    if not sys.platform.startswith("linux"):
        return None
    path = shutil.which("setpriv")
    if path is None:
        log.warning("event=no_pdeathsig reason='setpriv (util-linux) not found: a task may outlive a killed agent'")
    return path


def pdeathsig_prefix() -> list[str]:
    """The command prefix that makes the task die with the agent, or ``[]`` where that is not possible."""
    setpriv = _setpriv()
    if setpriv is None:
        return []
    return [setpriv, "--pdeathsig", "KILL", "--", "/bin/sh", "-c", _PPID_GUARD, str(os.getpid())]


class TaskTree:
    """The mark of one task's processes (random per supervisor), its record file and its guard process.

    ``name`` is the task's, for messages; ``record`` the file naming the tree for the next agent (``None``: no
    record). The guard process runs on Linux only.
    """

    def __init__(self, name: str, record: str | os.PathLike[str] | None) -> None:
        self.name = name
        self.token = secrets.token_hex(8)
        self.env_var = reaper.tree_env_var(self.token)  # marks the tree's processes (set to 1; inherited)
        self._record = Path(record) if record is not None else None
        self._use_guard = sys.platform.startswith("linux")
        self._guard: subprocess.Popen[bytes] | None = None
        self._guard_w = -1

    @property
    def guard_pid(self) -> int | None:
        return self._guard.pid if self._guard is not None else None

    def settle_predecessor(self) -> None:
        """Kill what a dead predecessor's task left running (its record names its tree's mark).

        Refuses to start when the recorded agent is still alive: two agents must not supervise one task.
        """
        if self._record is None:
            return
        try:
            doc = json.loads(self._record.read_bytes())
        except FileNotFoundError:
            return
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            log.warning("event=task_record_unreadable task=%s path=%s error=%r", self.name, self._record, str(e))
            return
        if not isinstance(doc, dict) or doc.get("boot_id") != reaper.boot_id():
            return  # another boot: nothing of it survives
        pid, token = doc.get("agent_pid"), doc.get("tree")
        if not isinstance(pid, int) or not isinstance(token, str) or not token.isalnum():
            return
        if pid != os.getpid() and reaper.start_ticks(pid) == doc.get("agent_start"):
            raise SpawnError(
                f"task {self.name} is still supervised by the agent with pid {pid} (record {self._record}); "
                "stop that agent first"
            )
        killed = reaper.kill_tree(token)
        if killed:
            log.warning(
                "event=leftovers_killed task=%s pids=%s reason='processes of a dead agent's task survived it'",
                self.name,
                killed,
            )

    def write_record(self) -> None:
        if self._record is None:
            return
        ensure_private_dir(self._record.parent, "state_dir")  # its records tell the next agent what to kill
        doc = {
            "task": self.name,
            "tree": self.token,
            "agent_pid": os.getpid(),
            "agent_start": reaper.start_ticks(os.getpid()),
            "boot_id": reaper.boot_id(),
        }
        tmp = self._record.with_name(f".{self._record.name}.tmp-{secrets.token_hex(4)}")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self._record)

    def remove_record(self) -> None:
        if self._record is None:
            return
        with contextlib.suppress(OSError, json.JSONDecodeError, UnicodeDecodeError):
            if json.loads(self._record.read_bytes()).get("tree") == self.token:  # ours, not a successor's
                self._record.unlink()

    def start_guard(self) -> None:
        """The process that kills the tree when this one dies (it reads EOF when our end of the pipe closes)."""
        if not self._use_guard:
            return
        r, w = os.pipe()  # both ends non-inheritable: only the guard gets r (as its stdin), nobody else gets w
        try:
            self._guard = subprocess.Popen(
                [sys.executable, "-I", reaper.__file__, "guard", self.token],
                stdin=r,
                start_new_session=True,  # outside the task's group: a group kill must not take the guard
            )
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
        self._guard_w = w

    def stop_guard(self) -> None:
        if self._guard_w >= 0:
            os.close(self._guard_w)  # the guard reads EOF, finds the tree gone, exits
            self._guard_w = -1
        if self._guard is not None:
            try:
                self._guard.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._guard.kill()
                self._guard.wait()
            self._guard = None

    def kill(self, *, exclude: frozenset[int] = frozenset()) -> None:
        """Kill every marked process but ``exclude`` (a standby and its children, which carry the mark too)."""
        killed = reaper.kill_tree(self.token, exclude=exclude)
        if killed:
            log.info("event=tree_killed task=%s pids=%s", self.name, killed)
