"""The agent's side: the sidecar beside each task (``psguard agent``) and ``psguard wrap``. It talks to the
trainer only through :mod:`psguard.handoff`."""

from psguard.handoff.client import report_failure, report_recovery, restart_ps_servers

# Kept importable from here, where earlier versions documented it: ``from psguard.agent import
# restart_ps_servers`` (the client calls live in the contract, so a trainer need not load the daemon).
__all__ = ["report_failure", "report_recovery", "restart_ps_servers"]
