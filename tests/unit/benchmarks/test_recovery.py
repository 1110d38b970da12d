"""``psguard bench recovery``'s command line: what it refuses before starting any job."""

from __future__ import annotations

import argparse

import pytest

from psguard.benchmarks.recovery import register
from psguard.errors import ConfigError


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["recovery", *argv])


def test_a_comparison_with_a_ps_kill_needs_a_chief_kill_to_compare() -> None:
    args = parse("--vs-ps-kill")
    with pytest.raises(ConfigError, match="--fault chief"):
        args.func(args)
    assert parse("--fault", "chief", "--vs-ps-kill").vs_ps_kill is True
