"""The JSON parser for what psguard reads from others: plain, finite, shallow JSON or a StrictJSONError."""

from __future__ import annotations

import pytest

from psguard.codec.strict_json import MAX_DEPTH, StrictJSONError, loads


def test_plain_json_parses() -> None:
    assert loads(b'{"a": [1, 2.5, "x", null, true]}') == {"a": [1, 2.5, "x", None, True]}


@pytest.mark.parametrize(
    ("data", "why"),
    [
        ("NaN", ""),
        ('{"ttl": Infinity}', "Infinity is not a JSON number"),
        ("[-Infinity]", "-Infinity is not a JSON number"),
        ("[1e999]", ""),
        ("1" * 40, ""),
        ("[" * (MAX_DEPTH + 2) + "]" * (MAX_DEPTH + 2), "deep"),
        ("{oops", "not valid JSON"),
    ],
)
def test_anything_else_is_refused(data: str, why: str) -> None:
    with pytest.raises(StrictJSONError, match=why or None):
        loads(data)


def test_a_size_limit_is_checked_before_parsing() -> None:
    with pytest.raises(StrictJSONError, match="at most 4"):
        loads(b"[1, 2, 3]", max_bytes=4)
