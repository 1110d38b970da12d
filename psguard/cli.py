"""The ``psguard`` command line.

Each subcommand lives in the module that owns its logic and registers itself through a ``register``
function; this file only lists them, so ``psguard ls`` never pays for importing TensorFlow.

Exit codes (documented in the README and stable):
  0 ok; 1 error (bad input, storage failure); 2 usage error; 3 corrupt checkpoint; 4 not found.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence

from psguard.dependencies import EXTRAS, install_hint, versions
from psguard.errors import (
    ConfigError,
    CorruptCheckpointError,
    NoCheckpointError,
    ObjectNotFoundError,
    PsguardError,
    UnsupportedFormatError,
)

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_CORRUPT = 3
EXIT_NOT_FOUND = 4

# Modules that contribute subcommands; each has ``register(subparsers) -> None``. The handlers they set with
# ``set_defaults(func=...)`` take the parsed namespace and return an exit code.
COMMAND_MODULES: tuple[str, ...] = (
    "psguard.demo",
    "psguard.store.cli",
    "psguard.trainer.export",
    "psguard.policy.cli",
    "psguard.benchmarks.cli",
    "psguard.agent.cli",
    "psguard.chaos.cli",
    "psguard.agent.wrap",
    "psguard.agent.status",
)

Handler = Callable[[argparse.Namespace], int]


def version_text() -> str:
    """psguard's, TensorFlow's (from its metadata: TensorFlow is not imported) and Python's versions."""
    v = versions()
    tf = f"TensorFlow {v['tensorflow']}" if v["tensorflow"] else f"TensorFlow: none. {EXTRAS['tensorflow']}"
    return f"psguard {v['psguard']}\n{tf}\nPython {v['python']}"


class _Version(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="psguard",
        description="Fault-tolerant checkpointing and recovery for TensorFlow parameter-server training.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    parser.add_argument("-V", "--version", action=_Version, help="print psguard, TensorFlow and Python versions")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    func: Handler = args.func
    try:
        return func(args)
    except (CorruptCheckpointError, UnsupportedFormatError) as e:
        print(f"psguard: error: {e}", file=sys.stderr)
        return EXIT_CORRUPT
    except (NoCheckpointError, ObjectNotFoundError) as e:
        print(f"psguard: error: {e}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except ConfigError as e:
        print(f"psguard: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except PsguardError as e:
        print(f"psguard: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except ModuleNotFoundError as e:
        hint = install_hint(e)
        if hint is None:
            raise
        print(f"psguard: error: {hint}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("psguard: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
