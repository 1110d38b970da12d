"""The durable log: content-addressed chunks, manifests (the commit), the journal, retention, its CLI.

It knows neither policies nor TensorFlow: it stores and verifies named numpy tensors and their deltas, on any
backend of :mod:`psguard.storage`. ``psguard.store.Store`` is the public entry point.
"""

from psguard.store.facade import Store
from psguard.store.gc import GcReport
from psguard.store.index import CheckpointInfo
from psguard.store.reader import LoadResult
from psguard.store.verify import Problem, VerifyReport
from psguard.store.writer import SaveTransaction

__all__ = ["CheckpointInfo", "GcReport", "LoadResult", "Problem", "SaveTransaction", "Store", "VerifyReport"]
