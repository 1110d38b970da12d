"""The generic config loader (psguard.config) that policy files and the rest of psguard use."""

from __future__ import annotations

import enum
import os
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest

from psguard.config import (
    Check,
    Duration,
    changed_keys,
    format_duration,
    from_data,
    invalid,
    load_yaml,
    loads_yaml,
    parse_duration,
    read_settings_file,
    validate,
)
from psguard.errors import ConfigError, PsguardError


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Inner:
    timeout: Duration = 30.0
    retries: Annotated[int, Check(lambda n: n >= 0, "(>= 0)")] = 3

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class Outer:
    name: str
    inner: Inner = Inner()
    ratio: float = 1.0
    enabled: bool = True
    mode: Literal["min", "max"] = "min"
    tags: tuple[str, ...] = ()
    pair: tuple[int, str] | None = None
    colour: Colour = Colour.RED
    labels: Mapping[str, int] = field(default_factory=dict)
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit > 100:
            raise invalid("limit", "at most 100", self.limit)


# --------------------------------------------------------------------------------------------- durations
@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("0.5s", 0.5),
        ("20s", 20.0),
        ("10m", 600.0),
        ("6h", 21600.0),
        ("7d", 604800.0),
        ("1w", 604800.0),
        ("1h30m", 5400.0),
        ("1h 30m", 5400.0),
        ("45", 45.0),
        (" 2m ", 120.0),
        (".5s", 0.5),
        (12, 12.0),
        (1.5, 1.5),
        (0, 0.0),
    ],
)
def test_parse_duration_accepts(text: object, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "bad", ["", "abc", "-5s", "5x", "1h30", "s", "1e3s", "5 s s", True, None, [1], float("inf"), -1]
)
def test_parse_duration_rejects(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(bad)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.5, "500ms"), (31.62, "31.6s"), (147.0, "2m27s"), (600, "10m"), (5400, "1h30m"), (604800, "7d")],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
    assert parse_duration(text) == pytest.approx(seconds, rel=0.01)


# ------------------------------------------------------------------------------------------------ loader
def test_from_data_converts_every_supported_type() -> None:
    out = from_data(
        Outer,
        {
            "name": "x",
            "inner": {"timeout": "2m", "retries": 0},
            "ratio": 2,
            "enabled": False,
            "mode": "max",
            "tags": ["a", "b"],
            "pair": [1, "one"],
            "colour": "blue",
            "labels": {"a": 1},
            "limit": None,
        },
    )
    assert out == Outer(
        name="x",
        inner=Inner(timeout=120.0, retries=0),
        ratio=2.0,
        enabled=False,
        mode="max",
        tags=("a", "b"),
        pair=(1, "one"),
        colour=Colour.BLUE,
        labels={"a": 1},
    )
    assert isinstance(out.ratio, float)
    with pytest.raises(TypeError):
        out.labels["b"] = 2  # type: ignore[index]  # read-only view


def test_defaults_fill_missing_keys() -> None:
    assert from_data(Outer, {"name": "x"}) == Outer(name="x")


@pytest.mark.parametrize(
    ("data", "path", "expected"),
    [
        ({"name": "x", "nmae": 1}, "nmae", "unknown key"),
        ({"name": "x", "inner": {"timout": "1s"}}, "inner.timout", "did you mean 'timeout'"),
        ({}, "name", "missing required key"),
        ({"name": 5}, "name", "expected a string, got 5"),
        ({"name": "x", "ratio": "fast"}, "ratio", "expected a number"),
        ({"name": "x", "ratio": True}, "ratio", "expected a number"),
        ({"name": "x", "enabled": "yes"}, "enabled", "expected true or false"),
        ({"name": "x", "limit": 1.5}, "limit", "expected an integer"),
        ({"name": "x", "limit": True}, "limit", "expected an integer"),
        ({"name": "x", "mode": "avg"}, "mode", "one of 'min', 'max'"),
        ({"name": "x", "tags": "a"}, "tags", "a list of a string"),
        ({"name": "x", "tags": ["a", 3]}, "tags[1]", "expected a string"),
        ({"name": "x", "pair": [1]}, "pair", "a list of 2 items"),
        ({"name": "x", "colour": "green"}, "colour", "one of 'red', 'blue'"),
        ({"name": "x", "labels": {"a": "b"}}, "labels.a", "an integer"),
        ({"name": "x", "inner": "fast"}, "inner", "a mapping of Inner settings"),
        ({"name": "x", "inner": {"timeout": "-1s"}}, "inner.timeout", "a duration such as"),
        ({"name": "x", "inner": {"retries": -1}}, "inner.retries", "(>= 0)"),
        ({"name": "x", "limit": 101}, "limit", "expected at most 100, got 101"),
        ([1, 2], "(top level)", "a mapping of Outer settings"),
    ],
)
def test_errors_name_source_key_and_expectation(data: object, path: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_data(Outer, data, source="test.yaml")
    message = str(err.value)
    assert message.startswith(f"test.yaml: {path}: "), message
    assert expected in message
    assert isinstance(err.value, PsguardError)


def test_validate_runs_checks_when_built_in_python() -> None:
    with pytest.raises(ConfigError, match=r"retries: expected \(>= 0\), got -2"):
        Inner(retries=-2)


def test_load_yaml_file(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("name: job\ninner:\n  timeout: 1h30m\n")
    assert load_yaml(Outer, f).inner.timeout == 5400.0


def test_load_yaml_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: no such file"):
        load_yaml(Outer, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"x\.yaml: line 2 column \d+: not valid YAML"):
        loads_yaml(Outer, "name: a\n  bad: [\n", source="x.yaml")
    with pytest.raises(ConfigError, match=r"x\.yaml: expected a mapping of settings, got an empty document"):
        loads_yaml(Outer, "# only a comment\n", source="x.yaml")
    with pytest.raises(ConfigError, match="key 'name' given twice"):
        loads_yaml(Outer, "name: a\nname: b\n", source="x.yaml")


SECRET = "hunter2-s3cr3t"


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (f"root:x:0:0:{SECRET}:/root:/bin/bash\n", "(top level): expected a mapping of Outer settings, got a string"),
        (f"- {SECRET}\n", "(top level): expected a mapping of Outer settings, got a list of 1 items"),
        (f"!{SECRET} x\n", "line 1 column 1: not valid YAML: a value YAML cannot build"),
        (f"!{SECRET}! x\n", "line 1 column 17: not valid YAML: a character or token YAML does not accept"),
        (f'name: "{SECRET}\\q"\n', "line 1 column 23: not valid YAML: a character or token"),
        (f"name: a\n  {SECRET}: [\n", "line 2 column "),
        (f"inner: {SECRET}\nuser: admin\n", "user: unknown key"),  # keys first: a value is never shown
        (f"name: {SECRET}\x01\n", "character 21: not valid YAML: a character YAML does not accept"),
    ],
)
def test_a_text_that_is_not_settings_is_never_quoted(text: str, where: str) -> None:
    """A settings path can be pointed at any file (a symlink to a password file): errors say where and what
    kind of problem, never a piece of the text (PyYAML's own message adds a snippet of the line)."""
    with pytest.raises(ConfigError) as err:
        loads_yaml(Outer, text, source="x.yaml")
    message = str(err.value)
    assert message.startswith("x.yaml: ") and where in message, message
    assert SECRET not in message, message


def test_an_unknown_key_is_named_cut_short() -> None:
    with pytest.raises(ConfigError) as err:
        loads_yaml(Outer, f"inner: {{{'k' * 100}: 1}}\n", source="x.yaml")
    assert str(err.value).startswith(f"x.yaml: inner.'{'k' * 40}...': unknown key (known keys: timeout, retries)")


def test_yaml_problems_that_quote_only_tokens_are_kept() -> None:
    with pytest.raises(ConfigError, match=r"line 2 column 1: not valid YAML: expected ',' or '\]', but got '<stream"):
        loads_yaml(Outer, "tags: [a, b\n", source="x.yaml")
    with pytest.raises(ConfigError, match=r"found character '\\t' that cannot start any token"):
        loads_yaml(Outer, "name: a\n\tx: 1\n", source="x.yaml")


def test_text_that_is_not_utf8_is_named_by_offset(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_bytes(b"name: \xff\xfe")
    with pytest.raises(ConfigError) as err:
        load_yaml(Outer, f)
    assert str(err.value) == f"{f}: not UTF-8 text (byte 6 cannot be decoded)"


def test_a_fifo_swapped_in_after_the_look_is_refused_without_blocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path is a regular file when looked at, a FIFO when opened (a race another user can win): the read
    must not wait for a writer that never comes."""
    path = tmp_path / "c.yaml"
    path.write_text("name: job\n")
    real_stat = os.stat

    def look_then_swap(target: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        result = real_stat(target, *args, **kwargs)
        if os.fspath(target) == str(path) and stat.S_ISREG(result.st_mode):
            path.unlink()
            os.mkfifo(path)
        return result

    monkeypatch.setattr(os, "stat", look_then_swap)
    outcome: list[object] = []

    def read() -> None:
        try:
            outcome.append(read_settings_file(path))
        except ConfigError as e:
            outcome.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # blocked in open(): let it go, then fail
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail("reading the settings file blocked on a FIFO swapped in after it was looked at")
    assert len(outcome) == 1 and isinstance(outcome[0], ConfigError), outcome
    assert "not a regular file" in str(outcome[0])


@dataclass(frozen=True)
class Window:
    low: int
    high: int

    def __post_init__(self) -> None:
        if self.high < self.low:
            raise ValueError("high: must not be below low")


@dataclass(frozen=True)
class Holder:
    window: Window


def test_plain_value_error_from_post_init_becomes_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^w\.yaml: window\.high: must not be below low$"):
        from_data(Holder, {"window": {"low": 2, "high": 1}}, source="w.yaml")


def test_unsupported_schema_type_is_a_programming_error() -> None:
    @dataclass(frozen=True)
    class Odd:
        value: set[int]

    with pytest.raises(TypeError, match="not supported"):
        from_data(Odd, {"value": [1]})


def test_changed_keys_lists_nested_differences() -> None:
    a = Outer(name="x")
    b = Outer(name="x", inner=Inner(timeout=60.0), mode="max")
    assert changed_keys(a, b) == ["inner.timeout: 30.0 -> 60.0", "mode: 'min' -> 'max'"]
    assert changed_keys(a, a) == []


def test_yaml_aliases_are_refused_before_they_can_multiply() -> None:
    """Nine aliases of nine aliases... ("billion laughs"): refused at the first alias, nothing expanded."""

    @dataclass(frozen=True)
    class Tiny:
        a: str = ""
        b: str = ""

    bomb = 'a: &a "xxxxxxxx"\nb: *a\n'
    with pytest.raises(ConfigError, match=r"aliases \(\*name\) are not accepted.*line 2"):
        loads_yaml(Tiny, bomb, source="bomb.yaml")
    assert loads_yaml(Tiny, 'a: "x"\n', source="ok.yaml") == Tiny(a="x")
