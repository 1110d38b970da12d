"""The durable log: content-addressed chunks, manifests (the commit), the journal, retention, its CLI.

It knows neither policies nor TensorFlow: it stores and verifies named numpy tensors and their deltas, on any
backend of :mod:`psguard.storage`. ``psguard.store.Store`` is the public entry point.
"""

from psguard.store.log import CheckpointInfo, GcReport, LoadResult, Problem, SaveTransaction, Store, VerifyReport

__all__ = ["CheckpointInfo", "GcReport", "LoadResult", "Problem", "SaveTransaction", "Store", "VerifyReport"]
