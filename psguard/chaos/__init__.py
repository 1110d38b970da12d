"""``psguard chaos``: faults injected into a real PS job, every operation in a history, checkers over it.

Modules: :mod:`~psguard.chaos.history` (the history file), :mod:`~psguard.chaos.scenario` (YAML scenarios),
:mod:`~psguard.agent.process.launcher` (the cluster under agents, shared with ``psguard demo``),
:mod:`~psguard.chaos.nemesis` (faults), :mod:`~psguard.chaos.checkers` (pure functions over the history),
:mod:`~psguard.chaos.runner`, :mod:`~psguard.chaos.report`, :mod:`~psguard.chaos.cli`.
"""
