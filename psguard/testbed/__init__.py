"""Real local servers and clusters for demos, benchmarks, chaos runs and tests.

Nothing here is a mock: each helper starts a real process (SeaweedFS, moto, HDFS, ``tf.distribute.Server``)
on free loopback ports and stops it, also when the caller fails.
"""
