"""Guards: what stops a distributed job cleanly instead of hanging or corrupting it.

:mod:`.watchdog` (a lost or hung peer stops every rank), :mod:`.atomic_io`
(checkpoints written atomically with a SHA-256 sidecar), :mod:`.replica_check` (dense
replicas identical on every rank), :mod:`.startup_guard` (the same schedule and dense
weights everywhere at start-up).
"""
