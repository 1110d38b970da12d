"""Configuration: YAML or plain data turned into frozen dataclasses, or a :class:`ConfigError` that says where.

Every part of psguard describes its configuration as frozen dataclasses with type hints (calling :func:`validate`
in ``__post_init__``) and loads it with :func:`load_yaml` or :func:`from_data`. The loader rejects unknown keys
(suggesting the closest), wrong types and impossible values, naming the file and the key path
(``durable.young_daly.mtbf_prior``). Field types: ``bool``, ``int``, ``float``, ``str``, ``None``, unions,
``Literal``, enums, ``tuple[X, ...]``, ``tuple[X, Y]``, ``Mapping[str, X]``, nested dataclasses, and
``Annotated[X, Parse(...), Check(...)]`` to convert (:data:`Duration`) or constrain a value. Checks over several
fields raise :func:`invalid` naming the key from ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import os
import re
import stat
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Annotated, Any, BinaryIO, Literal, TypeVar, Union, get_args, get_origin

import yaml

from psguard.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class Parse:
    """``Annotated`` marker: convert the raw value with ``func`` before type checking it.

    ``func`` raises ``ValueError`` or ``TypeError`` on input it cannot convert; ``expected`` says in words
    what it accepts, for the error message.
    """

    func: Callable[[Any], Any]
    expected: str


@dataclass(frozen=True)
class Check:
    """``Annotated`` marker: the (converted) value must satisfy ``test``; ``expected`` describes it."""

    test: Callable[[Any], bool]
    expected: str


def invalid(key: str, expected: str, got: object) -> ConfigError:
    """The error a dataclass's ``__post_init__`` raises for a bad value of its field ``key``.

    ``key`` is relative to the dataclass; the loader prefixes the file and the section's path.
    """
    return ConfigError(f"{key}: expected {expected}, got {got!r}")


# --- durations ------------------------------------------------------------------------------------------

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d|w)?", re.ASCII)
DURATION_FORMS = "a duration such as 500ms, 0.5s, 20s, 10m, 6h, 7d or 1h30m (a bare number means seconds)"


def parse_duration(value: object) -> float:
    """Seconds in ``value``: a number of seconds, or text like ``500ms``, ``0.5s``, ``10m``, ``6h``, ``1h30m``.

    Raises ``ValueError`` for anything else, including negative, infinite and NaN values.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected {DURATION_FORMS}, got {value!r}")
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:  # an integer of hundreds of digits
            raise ValueError(f"expected a finite duration >= 0, got a {len(str(abs(value)))}-digit integer") from None
    elif isinstance(value, str):
        text = value.strip()
        pos, seconds, parts = 0, 0.0, 0
        while pos < len(text):
            m = _PART.match(text, pos)
            if m is None or (m.group(2) is None and (parts or m.end() != len(text))):
                raise ValueError(f"expected {DURATION_FORMS}, got {value!r}")
            seconds += float(m.group(1)) * _UNITS[m.group(2) or "s"]
            pos, parts = m.end(), parts + 1
            while pos < len(text) and text[pos] == " ":
                pos += 1
        if not parts:
            raise ValueError(f"expected {DURATION_FORMS}, got {value!r}")
    else:
        raise ValueError(f"expected {DURATION_FORMS}, got {value!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"expected a finite duration >= 0, got {value!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """Short human form of ``seconds``: ``500ms``, ``31.6s``, ``10m``, ``2h27m``, ``7d``."""
    if not math.isfinite(seconds):
        return str(seconds)
    sign, s = ("-", -seconds) if seconds < 0 else ("", seconds)
    if s == 0:
        return "0s"
    if s < 1:
        return f"{sign}{round(s * 1000, 1):g}ms"
    if s < 60:
        return f"{sign}{round(s, 1):g}s"
    for big, small, big_name, small_name in ((86400, 3600, "d", "h"), (3600, 60, "h", "m"), (60, 1, "m", "s")):
        if s >= big:
            whole, rest = divmod(round(s / small) * small, big)
            return f"{sign}{int(whole)}{big_name}" + (f"{int(rest // small)}{small_name}" if rest else "")
    raise AssertionError("unreachable")  # pragma: no cover


Duration = Annotated[float, Parse(parse_duration, DURATION_FORMS)]
"""Seconds as a float; in a file also ``"500ms"``, ``"20s"``, ``"10m"``, ``"6h"``, ``"7d"``, ``"1h30m"``."""


# --- loading --------------------------------------------------------------------------------------------


class _Invalid(Exception):
    """Internal: a bad value at ``path``; turned into a :class:`ConfigError` naming the source."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message


def _join(path: str, key: str | int) -> str:
    return f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else key)


def _expected(path: str, expected: str, got: object) -> _Invalid:
    try:
        shown = repr(got)
    except ValueError:  # an integer too long to print
        shown = f"an {type(got).__name__} too long to show"
    if len(shown) > 80:
        shown = f"{shown[:60]}... ({len(shown)} characters)"
    return _Invalid(path, f"expected {expected}, got {shown}")


class _OwnYAMLError(yaml.MarkedYAMLError):
    """A YAML error psguard's loader raises; its ``problem`` is psguard's own words."""

    problem: str

    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(None, None, problem, mark)  # type: ignore[no-untyped-call]


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe loader that refuses a key given twice in one mapping (PyYAML silently keeps the last), and
    aliases (``*name``): nine nested aliases of nine make a billion nodes to validate ("billion laughs"), and
    no psguard setting needs them."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
            raise _OwnYAMLError(f"aliases (*name) are not accepted in psguard files (line {mark.line + 1})", mark)
        return super().compose_node(parent, index)


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)  # type: ignore[no-untyped-call]
        if key in seen:
            mark = key_node.start_mark
            raise _OwnYAMLError(f"key {_shown_key(key)} given twice (line {mark.line + 1})", mark)
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


#: Largest integer a setting may hold (counts, steps, sizes): a YAML integer of 400 digits is a mistake, and
#: turning one into a float overflows.
MAX_INT = 2**63 - 1
#: Largest settings file read: a policy or scenario is a page of YAML.
MAX_FILE_BYTES = 1 << 20


def read_settings_file(path: str | os.PathLike[str]) -> str:
    """The text of a settings file (UTF-8); :class:`ConfigError` when it is not a regular file of reasonable size."""
    source = os.fspath(path)
    with open_settings_file(source) as f:
        return settings_text(read_settings_from(f, source)[0], source)


def settings_text(data: bytes, source: str) -> str:
    """``data`` decoded as UTF-8; the error gives the offset of the first bad byte, never the byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{source}: not UTF-8 text (byte {e.start} cannot be decoded)") from None


def open_settings_file(path: str | os.PathLike[str]) -> BinaryIO:
    """The settings file at ``path``, open for reading; :class:`ConfigError` unless it is a regular file of at
    most :data:`MAX_FILE_BYTES`.

    What the path names is looked at first (a device is not even opened), then opened with ``O_NONBLOCK`` (a FIFO
    swapped in after the look is not waited on) and the descriptor itself checked."""
    source = os.fspath(path)
    try:
        _check_settings_file(os.stat(source), source)
        fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such file") from None
    except OSError as e:
        raise ConfigError(f"{source}: cannot read: {e.strerror}") from None
    f = os.fdopen(fd, "rb")
    try:
        _check_settings_file(os.fstat(fd), source)
    except BaseException:
        f.close()
        raise
    return f


def _check_settings_file(st: os.stat_result, source: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file (a pipe, socket or device)"
        raise ConfigError(f"{source}: cannot read: it is {kind}")
    if st.st_size > MAX_FILE_BYTES:
        raise ConfigError(f"{source}: {st.st_size} bytes is too large for a settings file (at most {MAX_FILE_BYTES})")


def read_settings_from(f: BinaryIO, source: str) -> tuple[bytes, os.stat_result]:
    """The whole of the settings file ``f`` (from :func:`open_settings_file`) and its ``fstat`` after the read:
    a size other than the bytes read, or a later mtime, means something wrote to it meanwhile."""
    try:
        f.seek(0)
        data = f.read(MAX_FILE_BYTES + 1)
        after = os.fstat(f.fileno())
    except OSError as e:
        raise ConfigError(f"{source}: cannot read: {e.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{source}: too large for a settings file (at most {MAX_FILE_BYTES} bytes)")
    return data, after


def load_yaml(cls: type[T], path: str | os.PathLike[str]) -> T:
    """Read the YAML file at ``path`` into ``cls`` (a dataclass); :class:`ConfigError` names file and key."""
    return loads_yaml(cls, read_settings_file(path), source=os.fspath(path))


def loads_yaml(cls: type[T], text: str, *, source: str = "<yaml>") -> T:
    """Like :func:`load_yaml` for YAML text already read; ``source`` names it in errors.

    A text that is not YAML, or not a mapping, may be any file a path was pointed at (a symlink to a password
    file): its errors give the place and the kind of problem, never a piece of the text (see :func:`_yaml_problem`).
    """
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}:" if mark is not None else ""
        if isinstance(e, yaml.reader.ReaderError):
            where = f" character {e.position + 1}:"
        raise ConfigError(f"{source}:{where} not valid YAML: {_yaml_problem(e)}") from None
    except RecursionError:
        raise ConfigError(f"{source}: not valid YAML: nested too deeply") from None
    except ValueError as e:  # the YAML constructor's own int(): past 4300 digits
        raise ConfigError(f"{source}: not valid YAML: {str(e)[:200]}") from None
    if data is None:
        raise ConfigError(f"{source}: expected a mapping of settings, got an empty document")
    return from_data(cls, data, source=source)


#: What PyYAML may quote in a problem that is not the text's own: its token names (``'<block end>'``, ``','``)
#: and a tab. Any other quoted part is a piece of the text (a character, a tag, a key).
_YAML_TOKENS = frozenset(
    repr(token.id) for token in vars(yaml.tokens).values() if isinstance(token, type) and hasattr(token, "id")
) | {repr("\t")}


def _yaml_problem(e: yaml.YAMLError) -> str:
    """What PyYAML found wrong, without the text: its ``problem`` when that quotes nothing but YAML's own token
    names, else the kind of problem. (``str(e)`` would add a snippet of the offending line.)"""
    if isinstance(e, _OwnYAMLError):
        return e.problem
    if isinstance(e, yaml.reader.ReaderError):
        return "a character YAML does not accept (a control character or a lone surrogate)"
    problem = getattr(e, "problem", None)
    if isinstance(problem, str) and problem:
        stripped = problem
        for token in _YAML_TOKENS:
            stripped = stripped.replace(token, "")
        if "'" not in stripped and '"' not in stripped:
            return problem
    if isinstance(e, yaml.scanner.ScannerError):
        return "a character or token YAML does not accept here"
    if isinstance(e, yaml.parser.ParserError):
        return "the structure breaks off or a token is out of place"
    if isinstance(e, yaml.constructor.ConstructorError):
        return "a value YAML cannot build (a tag such as !name, or bad !!binary data)"
    return f"{type(e).__name__}"


def from_data(cls: type[T], data: object, *, source: str = "<data>") -> T:
    """Convert plain data (dicts, lists, scalars, as from YAML or JSON) into ``cls``, a dataclass."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    try:
        result: T = _convert(cls, data, "")
    except _Invalid as e:
        raise ConfigError(f"{source}: {e.path or '(top level)'}: {e.message}") from None
    return result


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _describe(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        parse = next((m for m in tp.__metadata__ if isinstance(m, Parse)), None)
        checks = [m.expected for m in tp.__metadata__ if isinstance(m, Check)]
        return " ".join([parse.expected if parse else _describe(args[0]), *checks])
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        return f"a list of {_describe(args[0])}" if len(args) == 2 and args[1] is Ellipsis else "a list"
    if tp is type(None):
        return "null"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return "a mapping"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def _convert(tp: Any, value: object, path: str) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        for meta in tp.__metadata__:
            if isinstance(meta, Parse):
                try:
                    value = meta.func(value)
                except (ValueError, TypeError):
                    raise _expected(path, meta.expected, value) from None
        result = _convert(args[0], value, path)
        for meta in tp.__metadata__:
            if isinstance(meta, Check) and not meta.test(result):
                raise _expected(path, meta.expected, value)
        return result
    if tp is Any:
        return value
    if tp is type(None):
        if value is not None:
            raise _expected(path, "null", value)
        return None
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _convert(options[0], value, path)
        for option in options:
            try:
                return _convert(option, value, path)
            except _Invalid:
                continue
        raise _expected(path, _describe(tp), value)
    if origin is Literal:
        for allowed in args:
            if value == allowed and type(value) is type(allowed):
                return allowed
        raise _expected(path, _describe(tp), value)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise _expected(path, _describe(tp), value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, _join(path, i)) for i, v in enumerate(value))
        if len(value) != len(args):
            raise _expected(path, f"a list of {len(args)} items", value)
        return tuple(_convert(a, v, _join(path, i)) for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if origin in (Mapping, dict) or tp in (Mapping, dict):
        if not isinstance(value, Mapping):
            raise _expected(path, "a mapping", value)
        key_tp, val_tp = args or (str, Any)
        out = {_convert(key_tp, k, path): _convert(val_tp, v, _join(path, str(k))) for k, v in value.items()}
        return types.MappingProxyType(out)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _convert_dataclass(tp, value, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise _expected(path, _describe(tp), value) from None
    if tp in (bool, str):
        if not isinstance(value, tp):
            raise _expected(path, _describe(tp), value)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _expected(path, "an integer", value)
        if abs(value) > MAX_INT:
            raise _expected(path, f"an integer of at most {len(str(MAX_INT))} digits", value)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float) or abs(value) > MAX_INT:
            raise _expected(path, "a number" if not isinstance(value, int) else "a number below 2^63", value)
        if value != value:
            raise _expected(path, "a number (not NaN)", value)
        return float(value)
    raise TypeError(f"config type {tp!r} at {path or '(top level)'} is not supported by psguard.config")


def _shown_key(key: object) -> str:
    """A key as errors name it: quoted, and cut short (a key is named, a value of a file not yet known to be
    settings never is)."""
    shown = repr(key) if isinstance(key, str) else f"{type(key).__name__} key"
    return shown if len(shown) <= 44 else f"{shown[:41]}...'"


def _kind(value: object) -> str:
    """What ``value`` is, without its content: how a document that is not a mapping of settings is named."""
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    if isinstance(value, list):
        return f"a list of {len(value)} items"
    return {bool: "true or false", int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _convert_dataclass(cls: type, value: object, path: str) -> Any:
    if not isinstance(value, Mapping):
        if not path:  # the whole document: perhaps not a settings file at all; never quote it
            raise _Invalid(path, f"expected a mapping of {cls.__name__} settings, got {_kind(value)}")
        raise _expected(path, f"a mapping of {cls.__name__} settings", value)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = _hints(cls)
    for key in value:  # every key first: a mapping that is not these settings is named by a key, not a value
        if not isinstance(key, str) or key not in fields:
            hint = difflib.get_close_matches(str(key), list(fields), n=1)
            maybe = f"; did you mean {hint[0]!r}?" if hint else ""
            shown = key if isinstance(key, str) and _shown_key(key) == repr(key) else _shown_key(key)
            raise _Invalid(_join(path, shown), f"unknown key (known keys: {', '.join(fields)}){maybe}")
    kwargs = {key: _convert(hints[key], raw, _join(path, key)) for key, raw in value.items()}
    for name, f in fields.items():
        no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name not in kwargs and no_default:
            raise _Invalid(_join(path, name), f"missing required key ({_describe(hints[name])})")
    try:
        return cls(**kwargs)
    except ValueError as e:  # ConfigError from invalid(), or a plain ValueError from a __post_init__
        message = str(e)
        key, sep, rest = message.partition(": ")
        if sep and key.replace(".", "").replace("_", "").isalnum():
            raise _Invalid(_join(path, key), rest) from None
        raise _Invalid(path, message) from None


def validate(obj: object) -> None:
    """Run the ``Check`` markers of ``obj``'s fields; call it from a config dataclass's ``__post_init__``.

    Raises :class:`ConfigError` naming the first field whose value fails a check. Fields that are ``None``
    where ``None`` is allowed are not checked.
    """
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"{obj!r} is not a dataclass instance")
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        for check in _checks(hints[f.name], value):
            if not check.test(value):
                raise invalid(f.name, check.expected, value)


def _checks(tp: Any, value: object) -> list[Check]:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return [m for m in tp.__metadata__ if isinstance(m, Check)] + _checks(args[0], value)
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        return [] if value is None or len(options) != 1 else _checks(options[0], value)
    return []


def changed_keys(old: object, new: object, path: str = "") -> list[str]:
    """``key: old -> new`` lines for the fields that differ between two instances of a config dataclass."""
    if dataclasses.is_dataclass(old) and type(old) is type(new) and not isinstance(old, type):
        return [
            line
            for f in dataclasses.fields(old)
            for line in changed_keys(getattr(old, f.name), getattr(new, f.name), _join(path, f.name))
        ]
    return [] if old == new else [f"{path or '(top level)'}: {old!r} -> {new!r}"]
