"""Kept for imports of earlier versions: in-process recovery lives in :mod:`psguard.trainer.recovery`, and the
calls users make are exported from :mod:`psguard` (``psguard.run_with_recovery``, ``psguard.exit_for_restart``,
``psguard.is_cluster_failure``)."""

from psguard.trainer.recovery import exit_for_restart, is_cluster_failure, reset_cluster_context, run_with_recovery

__all__ = ["exit_for_restart", "is_cluster_failure", "reset_cluster_context", "run_with_recovery"]
