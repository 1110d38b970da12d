"""Keeping the agent's one task alive: supervise it (:mod:`.supervisor`, its whole process tree: :mod:`.tree`,
:mod:`.reaper`), keep its next process warm (:mod:`.standby`), judge it (:mod:`.prober`, :mod:`.hang`); the
built-in server (:mod:`.tf_server`) and localhost clusters of agents (:mod:`.launcher`). Nothing here knows the
tiers or the HTTP control plane."""
