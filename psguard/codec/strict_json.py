"""JSON from storage and the spool, parsed so that a hostile document costs bounded time and memory.

Python's ``json`` accepts ``NaN`` and ``Infinity``, turns ``1e999`` into ``inf``, parses integers of any length
(and raises a bare ``ValueError`` past 4300 digits, after the quadratic work), and recurses once per nesting
level (``RecursionError`` deep down). A manifest, journal entry or spool capture is written by psguard and never
needs any of that, so every one of these is refused here, as :class:`StrictJSONError`, which the callers turn into
a :class:`~psguard.errors.CorruptCheckpointError` naming the checkpoint or capture.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

#: Digits of the longest integer accepted: 2**63 has 19. Sizes, steps, CRC32Cs and shapes all fit.
MAX_INT_DIGITS = 19
#: Nesting levels accepted (objects and arrays). psguard's own documents nest 6 deep; metadata gets the rest.
MAX_DEPTH = 64


class StrictJSONError(ValueError):
    """The bytes are not a JSON document psguard could have written (the message says why)."""


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise StrictJSONError(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _float(text: str) -> float:
    if len(text) > 64:
        raise StrictJSONError(f"a number of {len(text)} characters")
    value = float(text)
    if not math.isfinite(value):
        raise StrictJSONError(f"the number {text[:40]} is out of range")
    return value


def _constant(name: str) -> Any:
    raise StrictJSONError(f"{name} is not a JSON number")


def fields_json(obj: Any, **extra: Any) -> dict[str, Any]:
    """A dataclass's fields as JSON-ready values (tuples as lists, mappings as dicts, objects with ``to_json``
    as theirs), then ``extra``: the one way psguard's reports and records are written out."""

    def plain(value: Any) -> Any:
        if hasattr(value, "to_json"):
            return value.to_json()
        if isinstance(value, tuple | list):
            return [plain(v) for v in value]
        return {k: plain(v) for k, v in value.items()} if isinstance(value, Mapping) else value

    return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)} | extra


class JsonFields:
    """A dataclass written out as :func:`fields_json` writes it."""

    def to_json(self) -> dict[str, Any]:
        return fields_json(self)


def loads(data: bytes | str, *, max_bytes: int | None = None) -> Any:
    """Parse ``data``; :class:`StrictJSONError` for anything but plain, finite, shallow JSON."""
    if max_bytes is not None and len(data) > max_bytes:
        raise StrictJSONError(f"{len(data)} bytes (at most {max_bytes})")
    try:
        value = json.loads(data, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except StrictJSONError:
        raise
    except RecursionError:
        raise StrictJSONError(f"nested more than {MAX_DEPTH} levels deep") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StrictJSONError(f"not valid JSON ({e})") from None
    except ValueError as e:  # anything else the decoder refuses
        raise StrictJSONError(str(e)[:200]) from None
    stack: list[tuple[Any, int]] = [(value, 1)]  # nesting checked iteratively: no recursion to exhaust
    while stack:
        item, depth = stack.pop()
        children: Any = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None and depth > MAX_DEPTH:
            raise StrictJSONError(f"nested more than {MAX_DEPTH} levels deep")
        stack.extend((child, depth + 1) for child in children or ())
    return value
