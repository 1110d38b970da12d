"""``psguard bench ...``: each benchmark module registers one sub-subcommand."""

from __future__ import annotations

import argparse
import importlib

BENCH_MODULES: tuple[str, ...] = (
    "psguard.benchmarks.store",
    "psguard.benchmarks.capture",
    "psguard.benchmarks.recovery",
    "psguard.benchmarks.scale",
    "psguard.benchmarks.follow",
    "psguard.benchmarks.wrap",
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="benchmarks against the plain-TensorFlow / raw-client baseline")
    inner = p.add_subparsers(dest="bench", metavar="BENCHMARK")
    inner.required = True
    for name in BENCH_MODULES:
        importlib.import_module(name).register(inner)
