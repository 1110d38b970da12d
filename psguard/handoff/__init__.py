"""The contract between a trainer and its agent: what both processes must agree on, and nothing else.

:mod:`~psguard.handoff.contract` (tiers, metadata keys, environment variables, exit codes),
:mod:`~psguard.handoff.spool` (the spool's layout and file format), :mod:`~psguard.handoff.client` (the
HTTP calls a trainer makes to its agent). It imports nothing from :mod:`psguard.trainer` or
:mod:`psguard.agent`; both import it.
"""
