"""Keeping the agent's one task alive: supervise it, judge its health, replace it fast.

:mod:`.supervisor` runs the task and restarts it (the policy and what it reports: :mod:`.lifecycle`; the
task's whole process tree, marked, recorded and killed: :mod:`.tree` and :mod:`.reaper`); :mod:`.standby` keeps
the next process warm; :mod:`.prober` and :mod:`.hang` judge the running task; :mod:`.tf_server` is the
built-in PS / worker task; :mod:`.launcher` starts whole localhost clusters of agents (demo, chaos, wrap).
Nothing here knows the tiers or the HTTP control plane: the agent (:mod:`psguard.agent.daemon`) wires them.
"""
