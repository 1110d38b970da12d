"""The ``psguard`` command line.

Each subcommand lives in the module that owns its logic and registers itself through a ``register``
function; this file only lists them, so ``psguard ls`` never pays for importing TensorFlow.

Exit codes (documented in the README and stable):
  0 ok; 1 error (storage failure, a run that failed, anything else); 2 bad input (usage: a bad argument,
  option, URL, policy or scenario file: :class:`~psguard.errors.ConfigError`); 3 corrupt checkpoint
  (:class:`~psguard.errors.CorruptCheckpointError`, :class:`~psguard.errors.UnsupportedFormatError`); 4 not found
  (:class:`~psguard.errors.NoCheckpointError`, a missing store, checkpoint or object); 130 interrupted; 141 the
  reader of the output went away (``psguard ls --json | head``), as for any Unix tool killed by SIGPIPE.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
import traceback
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
from psguard.handoff.contract import QUIET_TENSORFLOW
from psguard.storage.registry import redact

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_CORRUPT = 3
EXIT_NOT_FOUND = 4
EXIT_BROKEN_PIPE = 128 + 13  # SIGPIPE, what a shell reports for a tool whose reader closed the pipe
#: The exit code of each error a command reports, the first kind that matches (any other: ``EXIT_ERROR``).
EXIT_CODES: tuple[tuple[tuple[type[PsguardError], ...], int], ...] = (
    ((CorruptCheckpointError, UnsupportedFormatError), EXIT_CORRUPT),
    ((NoCheckpointError, ObjectNotFoundError), EXIT_NOT_FOUND),
    ((ConfigError,), EXIT_USAGE),
)

# Modules that contribute subcommands; each has ``register(subparsers) -> None``. The handlers they set with
# ``set_defaults(func=...)`` take the parsed namespace and return an exit code. The agent's first: a replacement
# PS node's agent is on its recovery's path, and a command stops the imports once its module registered it.
COMMAND_MODULES: tuple[str, ...] = (
    "psguard.agent.cli",
    "psguard.demo",
    "psguard.store.cli",
    "psguard.store.follow",
    "psguard.trainer.export",
    "psguard.trainer.publish",
    "psguard.policy.cli",
    "psguard.benchmarks.cli",
    "psguard.chaos.cli",
    "psguard.agent.wrap",
    "psguard.agent.control.status",
    "psguard.handoff.mapped",
)

Handler = Callable[[argparse.Namespace], int]

#: Client libraries whose DEBUG logs carry request headers: never below INFO, even with -vv.
_CHATTY_CLIENTS = ("botocore", "aiobotocore", "s3fs", "gcsfs", "google", "urllib3", "hdfs_native", "fsspec")


class _Version(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        v = versions()  # TensorFlow's from its metadata: it is not imported
        tf = f"TensorFlow {v['tensorflow']}" if v["tensorflow"] else f"TensorFlow: none. {EXTRAS['tensorflow']}"
        print(f"psguard {v['psguard']}\n{tf}\nPython {v['python']}")
        parser.exit()


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole CLI; with ``argv``, only as far as the module of the command it names (the others import numpy,
    the demo's model, the benchmarks: 0.3 s of a ``psguard agent``'s start, which a lost PS node waits for)."""
    parser = argparse.ArgumentParser(
        prog="psguard",
        description="Fault-tolerant checkpointing and recovery for TensorFlow parameter-server training.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    parser.add_argument("-V", "--version", action=_Version, help="print psguard, TensorFlow and Python versions")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    wanted = next((a for a in argv if not a.startswith("-")), None) if argv is not None else None
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
        if wanted is not None and wanted in sub.choices:
            break
    return parser


class RedactingFormatter(logging.Formatter):
    """Every line the CLI logs, traceback included, with the user info of URLs hidden (``s3://***@bucket``):
    a library's exception message can quote the URL it was given, credentials and all."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def _error(e: BaseException) -> None:
    print(f"psguard: error: {redact(str(e))}", file=sys.stderr)


def quiet_tensorflow(verbose: int) -> None:
    """Default TensorFlow's C++ logging off in this process (and the tasks it starts) before any command imports
    TensorFlow: a command's output is not the place for it. ``-vv`` leaves it alone."""
    if verbose >= 2:
        return
    for key, value in QUIET_TENSORFLOW.items():
        os.environ.setdefault(key, value)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)  # the command modules import TensorFlow lazily, inside their handlers
    args = parser.parse_args(argv)
    quiet_tensorflow(args.verbose)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
    for library in _CHATTY_CLIENTS:  # at DEBUG they print requests and their headers (AWS key ids, signatures)
        logging.getLogger(library).setLevel(max(level, logging.INFO))
    func: Handler = args.func
    try:
        code = func(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handlers below, not at interpreter exit
        return code
    except BrokenPipeError:  # stdout to /dev/null: its reader is gone, and the final flush would print the error
        with contextlib.suppress(OSError, ValueError):  # stdout is not a file descriptor (captured in a test)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return EXIT_BROKEN_PIPE
    except PsguardError as e:
        _error(e)
        return next((code for kinds, code in EXIT_CODES if isinstance(e, kinds)), EXIT_ERROR)
    except ModuleNotFoundError as e:
        hint = install_hint(e)
        if hint is None:
            raise
        print(f"psguard: error: {hint}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("psguard: interrupted", file=sys.stderr)
        return 130
    except Exception:
        # Python would print the traceback as is; it may quote a URL with its credentials.
        print(redact(traceback.format_exc()), file=sys.stderr, end="")
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
