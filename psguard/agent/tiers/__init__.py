"""The checkpoint tiers an agent holds: the chief's memory tier (:mod:`.memory_tier`), fed and read through the
spool (:mod:`.spool_server`) and made durable (:mod:`.persister`); each PS's shards on its own agent
(:mod:`.shards`) with their peer copies. They import numpy, so the daemon imports them lazily."""
