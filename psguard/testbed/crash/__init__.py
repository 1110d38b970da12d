"""Crash points, enumerated (ALICE, OSDI'14; CrashMonkey, OSDI'18; LazyFS, VLDB'24).

For each path of psguard that writes state another process relies on (the durable log's saves, compaction, gc,
retention, leases and journal, on a local folder and on S3; the spool hand-off; the memory tier's files), a real
run is recorded once: every mutating storage or file-system call it makes (:mod:`.recorder`). Then the run is
repeated and killed at each point between two calls, as a real process death (:mod:`.runner`), on a local folder
also with every write that no ``fsync`` made durable dropped (:mod:`.lazyfs`). After each crash a fresh process
checks what is left: the store holds exactly the acknowledged commits, nothing torn, and its next gc and save go
ahead (:mod:`.store_check`); the spool and the tier files answer a successor as their protocols promise
(:mod:`.handoff_paths`). ``python -m psguard.testbed.crashpoints`` runs it and reports the points per path.
"""
