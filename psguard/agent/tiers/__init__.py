"""The checkpoint tiers an agent holds: the memory tier and the path from it to the durable log.

:mod:`.memory_tier` is the chief's snapshot; :mod:`.spool_server` feeds it from the trainer's captures and
answers its restores; :mod:`.persister` writes it to the durable log; :mod:`.shards` keeps a PS's own shards
on its agent and coordinates them from the chief's, its tier kept in the files a restore hands its PS
(:mod:`.tier_files`). These import numpy and the storage clients, so only the
agents that hold a tier load them (the daemon imports them lazily).
"""
