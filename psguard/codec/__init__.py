"""What the contract and the durable log both encode: dtype names and shape limits (:mod:`.dtypes`), a tensor's
bytes and string tensors' serialisation (:mod:`.tensor_bytes`), and the strict JSON parser (:mod:`.strict_json`).

A floor below both ``psguard.handoff`` (the spool and tier files the trainer and agent exchange) and
``psguard.store`` (chunks and manifests), so that the contract needs nothing of the store; it imports no other
psguard module (``tests/system/test_layout.py`` holds both).
"""
