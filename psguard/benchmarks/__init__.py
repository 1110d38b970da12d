"""Benchmarks that compare psguard with the plain-TensorFlow (or raw-client) baseline in the same run.

Every benchmark prints ratios, not just seconds: these machines are noisy, and a ratio of two things measured
side by side, alternating, in one process tree is what stays meaningful. Results go to BENCHMARKS.md.
"""
