"""The manifest: one JSON document per checkpoint, written last, that commits it.

A manifest lists every tensor of the checkpoint with its dtype, shape and how to rebuild it (whole from
chunks, changed rows over the parent, or unchanged), plus step, parent, metadata (data position,
partitioning, user values) and metrics. It carries a SHA-256 of its own canonical body, so a truncated or
bit-flipped manifest is detected before anything is trusted, and every field that becomes part of a storage
key (chunk hashes, parent id) is checked against a strict pattern, so a hostile manifest cannot point a
reader outside the store. The format is specified in docs/storage-format.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from psguard.codec import strict_json
from psguard.codec.dtypes import DTYPE_NAMES, MAX_DIMS, STRING, dtype_from_name, itemsize_of, logical_nbytes
from psguard.errors import ConfigError, CorruptCheckpointError, UnsupportedFormatError

FORMAT_NAME = "psguard-manifest"
#: The newest format this code reads. Version 2 adds the ``sharded`` encoding (a tensor stored in parts that
#: different processes wrote); a manifest without a sharded entry is still written as version 1, so readers
#: that only know version 1 keep reading every checkpoint that has no sharded tensor.
FORMAT_VERSION = 2
FORMAT_VERSION_V1 = 1

MANIFEST_PREFIX = "manifests/"
CHUNK_PREFIX = "chunks/"
JOURNAL_PREFIX = "journal/"
LOCK_PREFIX = "locks/"

_HASH_RE = re.compile(r"^[0-9a-f]{64}$")
_ID_RE = re.compile(r"^[0-9]{12}-[0-9a-f]{8}$")

Encoding = Literal["full", "rows", "same", "sharded"]
PartEncoding = Literal["full", "rows", "same"]
#: A manifest larger than this is refused unread: a 2M x 32 table in 8 MiB chunks takes 5 KiB, a delta of a
#: million changed rows in 16384-row segments under 20 KiB, so this leaves room for any real checkpoint.
MAX_MANIFEST_BYTES = 64 << 20
#: Largest step (ids hold it in 12 digits).
MAX_STEP = 10**12 - 1
#: Times psguard writes (``committed_at``, a lease's ``created_at``) are seconds since 1970 before the year 10000.
MAX_TIMESTAMP = 253_402_300_800.0

Kind = Literal["full", "delta"]


def tensor_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a tensor, or None.

    Names are TF checkpoint keys (``model/embedding/.ATTRIBUTES/VARIABLE_VALUE``), ``/``-separated paths; a tool
    that writes a file per tensor must not be led out of its folder by one, so a name is refused when it is empty,
    starts with ``/``, has an empty, ``.`` or ``..`` part, or a control character. TF itself makes such a key only
    of an odd object graph (a variable at the root of its ``tf.train.Checkpoint``, an attribute named ``.``)."""
    if not name:
        return "is empty"
    bad = next((ch for ch in name if unicodedata.category(ch) == "Cc"), None)
    if bad is not None:
        return f"has a control character (U+{ord(bad):04X})"
    if name.startswith("/"):
        return "starts with '/' (an absolute path)"
    parts = name.split("/")
    if "" in parts:
        return "has an empty part ('//' or a trailing '/')"
    dots = next((p for p in parts if p in (".", "..")), None)
    return f"has a {dots!r} part" if dots is not None else None


def check_tensor_name(name: object) -> str:
    """``name`` if it can name a tensor (:func:`tensor_name_problem`), else :class:`ConfigError` saying why and
    what to do: writers refuse what every reader would refuse."""
    if not isinstance(name, str):
        raise ConfigError(f"tensor name {name!r} is not a string")
    problem = tensor_name_problem(name)
    if problem is not None:
        raise ConfigError(
            f"tensor name {name[:200]!r} {problem}: names are TF checkpoint keys, '/'-separated paths that must stay "
            "inside any folder a tool writes them to. TF makes such a key for a variable that is the root of its "
            "tf.train.Checkpoint or an attribute named '.': attach the variable under a plain attribute name"
        )
    return name


def new_checkpoint_id(step: int) -> str:
    """``<step, 12 digits>-<8 random hex>``: sorts by step, never collides between writers."""
    if step < 0 or step >= 10**12:
        raise ValueError(f"step must be in [0, 1e12), got {step}")
    return f"{step:012d}-{secrets.token_hex(4)}"


def is_checkpoint_id(text: str) -> bool:
    return bool(_ID_RE.match(text))


def step_of_id(checkpoint_id: str) -> int:
    return int(checkpoint_id.split("-", 1)[0])


def manifest_key(checkpoint_id: str) -> str:
    return f"{MANIFEST_PREFIX}{checkpoint_id}.json"


def chunk_key(digest: str) -> str:
    return f"{CHUNK_PREFIX}{digest[:2]}/{digest}"


@dataclass(frozen=True)
class ChunkRef:
    """A content-addressed chunk: SHA-256 of its bytes (its name), its size and its CRC32C."""

    hash: str
    size: int
    crc32c: int

    def to_json(self) -> dict[str, Any]:
        return {"hash": self.hash, "size": self.size, "crc32c": self.crc32c}


@dataclass(frozen=True)
class Segment:
    """A run of changed rows: the ids in one chunk (int64 little-endian), their rows in another."""

    count: int
    ids: ChunkRef
    values: ChunkRef


@dataclass(frozen=True)
class Part:
    """Rows ``[offset, offset + rows)`` of a sharded tensor (format version 2), written by the process that
    hosts them: a version-1 entry of the shard seen as a tensor of shape ``[rows, *shape[1:]]`` (``full``:
    chunks cut at row boundaries; ``rows``: ids relative to ``offset``; ``same``: unchanged)."""

    offset: int
    rows: int
    encoding: PartEncoding
    chunks: tuple[ChunkRef, ...] = ()
    segments: tuple[Segment, ...] = ()

    @property
    def stop(self) -> int:
        return self.offset + self.rows

    def refs(self) -> list[ChunkRef]:
        return _refs(self.chunks, self.segments)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"offset": self.offset, "rows": self.rows, "encoding": self.encoding}
        d.update(_payload_json(self.encoding, self.chunks, self.segments))
        return d


def _refs(chunks: tuple[ChunkRef, ...], segments: tuple[Segment, ...]) -> list[ChunkRef]:
    return [*chunks, *(r for s in segments for r in (s.ids, s.values))]


def _payload_json(encoding: str, chunks: tuple[ChunkRef, ...], segments: tuple[Segment, ...]) -> dict[str, Any]:
    """A part's encoding-specific keys: the same layout as a whole entry's (:meth:`TensorEntry.to_json`)."""
    if encoding == "full":
        return {"chunks": [c.to_json() for c in chunks]}
    if encoding == "rows":
        return {
            "count": sum(s.count for s in segments),
            "segments": [{"count": s.count, "ids": s.ids.to_json(), "values": s.values.to_json()} for s in segments],
        }
    return {}


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    encoding: Encoding
    chunks: tuple[ChunkRef, ...] = ()
    segments: tuple[Segment, ...] = ()
    parts: tuple[Part, ...] = ()  # encoding "sharded" only (format version 2)

    @property
    def logical_bytes(self) -> int:
        return logical_nbytes(self.dtype, self.shape, self.chunks if self.encoding == "full" else ())

    @property
    def whole(self) -> bool:
        """Whether this entry alone gives the whole tensor (a chain is read from its newest whole entry)."""
        return self.encoding == "full" or (self.encoding == "sharded" and all(p.encoding == "full" for p in self.parts))

    def refs(self) -> list[ChunkRef]:
        return _refs(self.chunks, self.segments) + [r for p in self.parts for r in p.refs()]

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape), "encoding": self.encoding}
        if self.encoding == "sharded":
            d["parts"] = [p.to_json() for p in self.parts]
        return d | _payload_json(self.encoding, self.chunks, self.segments)


@dataclass(frozen=True)
class Manifest:
    id: str
    step: int
    kind: Kind
    parent: str | None
    base: str  # id of the full checkpoint this chain starts from (itself for a full one)
    chain_length: int  # 0 for a full checkpoint, parent's + 1 for a delta
    committed_at: float
    tensors: Mapping[str, TensorEntry]
    metadata: Mapping[str, Any] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)
    stats: Mapping[str, int] = field(default_factory=dict)
    writer: str = ""

    def refs(self) -> list[ChunkRef]:
        return [r for t in self.tensors.values() for r in t.refs()]

    def body(self) -> dict[str, Any]:
        body = {f.name: getattr(self, f.name) for f in fields(self)}
        body.update(metadata=dict(self.metadata), metrics=dict(self.metrics), stats=dict(self.stats))
        return body | {"tensors": {name: t.to_json() for name, t in self.tensors.items()}}

    @property
    def format_version(self) -> int:
        """2 only when a tensor is sharded: every other manifest stays readable by version-1 readers."""
        return FORMAT_VERSION if any(t.encoding == "sharded" for t in self.tensors.values()) else FORMAT_VERSION_V1

    def to_bytes(self) -> bytes:
        body = self.body()
        doc = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "sha256": hashlib.sha256(_canonical(body)).hexdigest(),
            "body": body,
        }
        return json.dumps(doc, indent=1, sort_keys=True).encode()


def _canonical(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


class _Checker:
    """Field validation that names the checkpoint and the field in every complaint."""

    def __init__(self, checkpoint: str) -> None:
        self.checkpoint = checkpoint

    def fail(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"checkpoint {self.checkpoint}: invalid manifest: {what}", checkpoint=self.checkpoint
        )

    def get(self, d: Mapping[str, Any], key: str, typ: type | tuple[type, ...], where: str) -> Any:
        if not isinstance(d, Mapping) or key not in d:
            raise self.fail(f"{where}{key} is missing")
        v = d[key]
        if not isinstance(v, typ) or (isinstance(v, bool) and typ in (int, (int, float))):
            raise self.fail(f"{where}{key} has type {type(v).__name__}")
        return v

    def nonneg(self, d: Mapping[str, Any], key: str, where: str, limit: int = 2**63 - 1) -> int:
        v: int = self.get(d, key, int, where)
        if v < 0:
            raise self.fail(f"{where}{key} is negative")
        if v > limit:
            raise self.fail(f"{where}{key} {v} is out of range (at most {limit})")
        return v

    def finite(self, value: Any, where: str) -> float:
        """A JSON number (strict_json already refused NaN, Infinity and overlong ones)."""
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise self.fail(f"{where} has type {type(value).__name__}, not a number")
        return float(value)

    def timestamp(self, value: Any, where: str) -> float:
        """Seconds since 1970, before the year 10000 (:data:`MAX_TIMESTAMP`): what ``time.time()`` gives."""
        t = self.finite(value, where)
        if not 0 <= t <= MAX_TIMESTAMP:
            raise self.fail(f"{where} {t:g} is not a time (seconds since 1970, before the year 10000)")
        return t

    def ref(self, d: Any, where: str) -> ChunkRef:
        if not isinstance(d, Mapping):
            raise self.fail(f"{where} is not an object")
        h = self.get(d, "hash", str, where + ".")
        if not _HASH_RE.match(h):
            raise self.fail(f"{where}.hash {h[:80]!r} is not a SHA-256 hex digest (refusing it as a path)")
        crc = self.nonneg(d, "crc32c", where + ".")
        if crc >= 2**32:
            raise self.fail(f"{where}.crc32c out of range")
        return ChunkRef(h, self.nonneg(d, "size", where + "."), crc)


def parse_manifest(data: bytes, *, expected_id: str | None = None) -> Manifest:
    """Parse and verify a manifest; any defect raises :class:`CorruptCheckpointError` naming it.

    Everything a reader later trusts is checked before anything is allocated from it: plain JSON, the body's step
    that of the id, every dtype one psguard stores, every shape agreeing with the bytes its chunks declare."""
    body, version = _envelope(data, expected_id)
    c = _Checker(expected_id or "?")
    cid = c.get(body, "id", str, "")
    if not _ID_RE.match(cid):
        raise c.fail(f"id {cid[:80]!r} is not a checkpoint id")
    if expected_id is not None and cid != expected_id:
        raise c.fail(f"id {cid} does not match its file name")
    c = _Checker(cid)
    step = c.nonneg(body, "step", "", MAX_STEP)
    if step != step_of_id(cid):
        raise c.fail(
            f"its body says step {step} but its id says step {step_of_id(cid)}: readers would order it differently"
        )
    kind, parent, base, chain_length = _lineage(c, body, cid)
    tensors = {name: _parse_tensor(c, kind, name, t, version) for name, t in c.get(body, "tensors", dict, "").items()}
    committed = c.timestamp(body.get("committed_at"), "committed_at")
    metrics_raw = c.get(body, "metrics", dict, "")
    metrics = {str(k): c.finite(v, f"metrics[{str(k)[:40]!r}]") for k, v in metrics_raw.items()}
    stats_raw = c.get(body, "stats", dict, "")
    stats = {str(k): c.nonneg(stats_raw, k, "stats.") for k in stats_raw}
    writer = body.get("writer", "")
    if not isinstance(writer, str):
        raise c.fail(f"writer has type {type(writer).__name__}")
    return Manifest(
        id=cid,
        step=step,
        kind=kind,  # type: ignore[arg-type]
        parent=parent,
        base=base,
        chain_length=chain_length,
        committed_at=committed,
        tensors=tensors,
        metadata=c.get(body, "metadata", dict, ""),
        metrics=metrics,
        stats=stats,
        writer=writer,
    )


def _envelope(data: bytes, expected_id: str | None) -> tuple[dict[str, Any], int]:
    """The body of a manifest and its format version, once the bytes are plain JSON, psguard's format in a version
    this psguard reads, and the body's checksum matches."""
    label = expected_id or "?"
    c = _Checker(label)
    try:
        doc = strict_json.loads(data, max_bytes=MAX_MANIFEST_BYTES)
    except strict_json.StrictJSONError as e:
        raise c.fail(f"{e}; the manifest is truncated, damaged or not psguard's") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise c.fail("not a psguard manifest")
    version = doc.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise c.fail("format_version is missing")
    if version > FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"checkpoint {label} was written in format version {version}; this psguard reads up to "
            f"{FORMAT_VERSION}: upgrade psguard to read it",
            checkpoint=label,
        )
    if version < 1:
        raise c.fail(f"format_version {version}")
    body = c.get(doc, "body", dict, "")
    digest = hashlib.sha256(_canonical(body)).hexdigest()
    if doc.get("sha256") != digest:
        raise c.fail("checksum mismatch: the manifest was modified or damaged")
    return body, version


def _lineage(c: _Checker, body: Mapping[str, Any], cid: str) -> tuple[str, str | None, str, int]:
    """A checkpoint's place in its chain: kind, parent, base and chain length, consistent with each other (a full
    checkpoint is its own base, a delta names a parent other than itself)."""
    kind = c.get(body, "kind", str, "")
    if kind not in ("full", "delta"):
        raise c.fail(f"kind {kind[:40]!r}")
    parent = body.get("parent")
    if kind == "delta":
        if not isinstance(parent, str) or not _ID_RE.match(parent):
            raise c.fail(f"parent {str(parent)[:80]!r} is not a checkpoint id (refusing it as a path)")
        if parent == cid:
            raise c.fail("it is its own parent")
    elif parent is not None:
        raise c.fail("a full checkpoint has a parent")
    base = c.get(body, "base", str, "")
    if not _ID_RE.match(base):
        raise c.fail(f"base {base[:80]!r} is not a checkpoint id")
    chain_length = c.nonneg(body, "chain_length", "", 10**9)
    if kind == "full" and (base != cid or chain_length != 0):
        raise c.fail("a full checkpoint must be its own base with chain_length 0")
    if kind == "delta" and chain_length < 1:
        raise c.fail("a delta must have chain_length >= 1")
    return kind, parent, base, chain_length


def parse_sharded_entry(
    c: _Checker, kind: str, where: str, t: Mapping[str, Any], dtype: str, shape: tuple[int, ...]
) -> TensorEntry:
    """A ``sharded`` entry's parts, every defect refused before a byte is allocated or read: parts sorted,
    contiguous, covering ``[0, shape[0])``; a ``full`` part's chunks whole rows adding up to its rows; a segment's
    chunks matching its count. Shared with ``SaveTransaction.commit``: what is committed is what a reader accepts."""
    if not shape:
        raise c.fail(f"{where} is sharded but has rank 0 (parts are row ranges)")
    if dtype == STRING:
        raise c.fail(f"{where} is a sharded string tensor (strings are stored whole)")
    try:
        itemsize = dtype_from_name(dtype).itemsize
    except ValueError as e:
        raise c.fail(f"{where}.dtype: {e}") from None
    rb = math.prod(shape[1:]) * itemsize  # 0 for a [n, 0] tensor: its parts hold no bytes
    raw = c.get(t, "parts", list, where + ".")
    if len(raw) > max(1, shape[0]):
        raise c.fail(f"{where} has {len(raw)} parts for {shape[0]} rows")
    parts: list[Part] = []
    expect = 0
    for i, p in enumerate(raw):
        pw = f"{where}.parts[{i}]"
        offset = c.nonneg(p, "offset", pw + ".")
        rows = c.nonneg(p, "rows", pw + ".")
        if offset != expect:
            what = "overlaps the previous part" if offset < expect else "leaves a gap after the previous part"
            raise c.fail(f"{pw} starts at row {offset}, expected {expect}: it {what} (parts sorted by offset)")
        if rows > shape[0] - offset:
            raise c.fail(f"{pw} rows [{offset}, {offset + rows}) out of bounds of {shape[0]} rows")
        expect = offset + rows
        enc = c.get(p, "encoding", str, pw + ".")
        if enc == "full":
            chunks = tuple(c.ref(r, f"{pw}.chunks[{j}]") for j, r in enumerate(c.get(p, "chunks", list, pw + ".")))
            if sum(r.size for r in chunks) != rows * rb or (rb and any(r.size % rb for r in chunks)):
                raise c.fail(f"{pw}: its chunks do not hold {rows} whole rows of {rb} bytes")
            parts.append(Part(offset, rows, "full", chunks=chunks))
        elif enc == "rows":
            if kind != "delta":
                raise c.fail(f"{pw} has row updates in a full checkpoint")
            segs, _ = _segments(c, pw, c.get(p, "segments", list, pw + "."), rb, rows)
            parts.append(Part(offset, rows, "rows", segments=segs))
        elif enc == "same":
            if kind != "delta":
                raise c.fail(f"{pw} is 'same' in a full checkpoint")
            parts.append(Part(offset, rows, "same"))
        else:
            raise c.fail(f"{pw}.encoding {enc!r}")
    if expect != shape[0]:
        raise c.fail(f"{where}: its parts cover rows [0, {expect}) of {shape[0]}")
    return TensorEntry(dtype, shape, "sharded", parts=tuple(parts))


def sharded_entry_from_parts(
    checkpoint_id: str, kind: str, name: str, dtype: str, shape: tuple[int, ...], parts: list[Any]
) -> TensorEntry:
    """Validate parts other processes wrote exactly as :func:`parse_manifest` would read them back (same
    checks, same :class:`CorruptCheckpointError` naming the checkpoint and the tensor)."""
    return parse_sharded_entry(_Checker(checkpoint_id), kind, f"tensors[{name!r}]", {"parts": parts}, dtype, shape)


def _parse_tensor(c: _Checker, kind: str, name: str, t: Any, version: int) -> TensorEntry:
    """One tensor entry, its shape checked against the bytes its chunks declare (nothing is read or allocated)."""
    where = f"tensors[{name[:80]!r}]"
    problem = tensor_name_problem(name)
    if problem is not None:
        raise c.fail(f"tensor name {name[:80]!r} {problem} (refusing it as a path)")
    if not isinstance(t, Mapping):
        raise c.fail(f"{where} is not an object")
    dtype = c.get(t, "dtype", str, where + ".")
    if dtype not in DTYPE_NAMES:
        raise c.fail(f"{where}.dtype {dtype[:40]!r} is not a dtype psguard stores, so it cannot be restored")
    shape_raw = c.get(t, "shape", list, where + ".")
    if len(shape_raw) > MAX_DIMS or not all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**63 for x in shape_raw
    ):
        raise c.fail(f"{where}.shape {str(shape_raw)[:80]}: at most {MAX_DIMS} non-negative dimensions")
    shape = tuple(shape_raw)
    itemsize = itemsize_of(dtype)
    elements = math.prod(shape)
    enc = c.get(t, "encoding", str, where + ".")
    if enc == "full":
        chunks = tuple(c.ref(r, f"{where}.chunks[{i}]") for i, r in enumerate(c.get(t, "chunks", list, where + ".")))
        declared = sum(r.size for r in chunks)
        if dtype == STRING:
            if declared < 8 * elements:
                raise c.fail(
                    f"{where}: a string tensor of shape {list(shape)} needs at least {8 * elements} bytes; "
                    f"its chunks declare {declared}"
                )
        elif declared != elements * itemsize:
            raise c.fail(
                f"{where}: shape {list(shape)} of {dtype} is {elements * itemsize} bytes; its chunks declare {declared}"
            )
        return TensorEntry(dtype, shape, "full", chunks=chunks)
    if enc == "rows":
        if kind != "delta":
            raise c.fail(f"{where} has row updates in a full checkpoint")
        if not shape or dtype == STRING:
            raise c.fail(f"{where}: row updates need a numeric tensor of at least one dimension")
        segs, total = _segments(
            c, where, c.get(t, "segments", list, where + "."), math.prod(shape[1:]) * itemsize, shape[0]
        )
        if "count" in t and t["count"] != total:
            raise c.fail(f"{where}.count {str(t['count'])[:40]} is not the sum of its segments' ({total})")
        return TensorEntry(dtype, shape, "rows", segments=segs)
    if enc == "same":
        if kind != "delta":
            raise c.fail(f"{where} is 'same' in a full checkpoint")
        return TensorEntry(dtype, shape, "same")
    if enc == "sharded":
        if version < 2:
            raise c.fail(f"{where} is sharded in a format_version {version} manifest (sharded needs 2)")
        return parse_sharded_entry(c, kind, where, t, dtype, shape)
    raise c.fail(f"{where}.encoding {enc[:40]!r}")


def _segments(c: _Checker, where: str, raw: list[Any], rb: int, rows: int) -> tuple[tuple[Segment, ...], int]:
    """A rows entry's segments, each one's chunk sizes matching its count of ``rb``-byte rows, at most ``rows``
    changed in all; and their count."""
    segs = []
    total = 0
    for i, s in enumerate(raw):
        sw = f"{where}.segments[{i}]"
        if not isinstance(s, Mapping):
            raise c.fail(f"{sw} is not an object")
        count = c.nonneg(s, "count", sw + ".")
        seg = Segment(count, c.ref(s.get("ids"), sw + ".ids"), c.ref(s.get("values"), sw + ".values"))
        if seg.ids.size != 8 * count or seg.values.size != rb * count:
            raise c.fail(f"{sw}: its chunk sizes do not match its {count} rows of {rb} bytes")
        total += count
        if total > rows:
            raise c.fail(f"{where} changes {total} rows or more of its {rows} rows")
        segs.append(seg)
    return tuple(segs), total


def parse_journal_entry(data: bytes, key: str) -> dict[str, Any]:
    """A journal entry (``{"id", "step", "kind", "parent", "committed_at"}``), checked like a manifest's fields;
    :class:`CorruptCheckpointError` naming the key otherwise."""
    try:
        doc = strict_json.loads(data, max_bytes=64 << 10)
    except strict_json.StrictJSONError as e:
        raise CorruptCheckpointError(f"journal entry {key}: {e}") from None
    cid = doc.get("id") if isinstance(doc, dict) else None
    c = _Checker(cid if isinstance(cid, str) and _ID_RE.match(cid) else f"journal entry {key}")
    if not isinstance(doc, dict) or not isinstance(cid, str) or not _ID_RE.match(cid):
        raise c.fail("not a journal entry with a checkpoint id")
    if c.nonneg(doc, "step", "", MAX_STEP) != step_of_id(cid):
        raise c.fail(f"journal entry {key}: its step differs from its id's")
    if doc.get("kind") not in ("full", "delta"):
        raise c.fail(f"journal entry {key}: kind {str(doc.get('kind'))[:40]!r}")
    parent = doc.get("parent")
    if parent is not None and not (isinstance(parent, str) and _ID_RE.match(parent)):
        raise c.fail(f"journal entry {key}: parent {str(parent)[:80]!r} is not a checkpoint id")
    c.timestamp(doc.get("committed_at"), f"journal entry {key}: committed_at")
    return doc
