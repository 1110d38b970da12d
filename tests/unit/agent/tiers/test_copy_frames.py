"""The peer copies' wire (psguard.agent.tiers.copy_frames): row digests that follow a delta and stay the specified
ones (in C, psguard/handoff/rows_digest.c, and in numpy), frames that round-trip and refuse damage, read whole or
straight into an array."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psguard.agent.tiers.copy_frames import _weights, decode_frame, encode_frame, read_frame_into, rows_digest
from psguard.errors import ConfigError, CorruptCheckpointError
from psguard.handoff import native


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cache of this module's own, with the C digest built in it (a fraction of a second)."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PSGUARD_CACHE", str(root))
        native.build_digest()
        yield root
    native.digest_function.cache_clear()


@pytest.fixture(params=["C", "numpy"])
def digest(request: pytest.FixtureRequest, cache: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each digest test twice: with the C digest loaded, and with numpy's (the C one turned off)."""
    monkeypatch.setenv("PSGUARD_CACHE", str(cache))
    monkeypatch.setenv(native.ENV_NATIVE_DIGEST, "1" if request.param == "C" else "0")
    native.digest_function.cache_clear()
    assert (native.digest_function() is not None) == (request.param == "C")
    yield request.param
    native.digest_function.cache_clear()


def test_a_digest_follows_a_delta_by_the_changed_rows_alone(digest: str) -> None:
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64, np.int64, np.int32, np.float16):
        a = rng.normal(size=(300, 7)).astype(dtype)
        ids = np.array([3, 17, 200, 299])
        new = rng.normal(size=(4, 7)).astype(dtype)
        d0 = rows_digest(a)
        b = a.copy()
        b[ids] = new
        delta = (d0 - rows_digest(a[ids], ids) + rows_digest(new, ids)) % (1 << 64)
        assert delta == rows_digest(b) != d0
    swapped = np.arange(20, dtype=np.float32).reshape(10, 2)
    assert rows_digest(swapped) != rows_digest(swapped[[1, 0, *range(2, 10)]])  # rows moved show
    assert rows_digest(np.arange(10, dtype=np.int64)) != rows_digest(np.arange(1, 11, dtype=np.int64))


def _reference_digest(values: np.ndarray, ids: np.ndarray | None = None) -> int:
    """rows_digest as specified, row by row in Python integers: owners and holders of different psguard versions
    (a rolling upgrade) must compute the same digest, however rows_digest is made fast."""
    mask = (1 << 64) - 1
    n = values.shape[0]
    flat = np.ascontiguousarray(values).reshape(n, -1).view(np.uint8)
    pad = (-flat.shape[1]) % 4
    words = np.concatenate([flat, np.zeros((n, pad), np.uint8)], axis=1).view(np.uint32)
    w = [int(x) for x in _weights(words.shape[1])]
    total = 0
    for r in range(n):
        h = sum(int(x) * wi for x, wi in zip(words[r], w[:-1], strict=True))
        h = (h + (int(ids[r] if ids is not None else r) + 1) * w[-1]) & mask
        h ^= h >> 30
        h = (h * 0xBF58476D1CE4E5B9) & mask
        h ^= h >> 27
        h = (h * 0x94D049BB133111EB) & mask
        h ^= h >> 31
        total = (total + h) & mask
    return total


@pytest.mark.parametrize(("dtype", "shape"), [(np.float32, (20000, 32)), (np.float16, (40000, 3)), (np.int64, (40,))])
def test_the_digest_is_the_specified_one_across_blocks_and_padding(
    dtype: Any, shape: tuple[int, ...], digest: str
) -> None:
    rng = np.random.default_rng(13)
    a = (rng.normal(size=shape) * 1000).astype(dtype)
    assert rows_digest(a) == _reference_digest(a)
    ids = rng.choice(10**6, shape[0], replace=False)
    assert rows_digest(a, ids) == _reference_digest(a, ids)
    assert rows_digest(a, ids.astype(np.int32)) == _reference_digest(a, ids)
    wide = (rng.normal(size=(shape[0], 2, *shape[1:])) * 1000).astype(dtype)
    assert rows_digest(wide[:, 0]) == _reference_digest(np.ascontiguousarray(wide[:, 0]))  # not contiguous
    # a range of a tensor: ids first..first+n-1 without an array of them, and the pieces sum to the whole
    first = 70001
    assert rows_digest(a, first=first) == _reference_digest(a, np.arange(first, first + shape[0]))
    half = shape[0] // 2
    assert (rows_digest(a[:half]) + rows_digest(a[half:], first=half)) & ((1 << 64) - 1) == rows_digest(a)
    with pytest.raises(ValueError, match="row ids for"):
        rows_digest(a, ids[:-1])
    with pytest.raises(ValueError, match="both given"):
        rows_digest(a, ids, first=1)


def test_the_c_digest_is_refused_when_someone_else_could_have_written_it(
    cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PSGUARD_CACHE", str(cache))
    library = native.digest_library()
    a = np.arange(64, dtype=np.float32).reshape(8, 8)
    try:
        os.chmod(library, 0o720)  # the group could have written it
        native.digest_function.cache_clear()
        with caplog.at_level(logging.INFO, logger=native.__name__):
            assert native.digest_function() is None
        said = [r.getMessage() for r in caplog.records]
        assert any("native_library_refused" in m for m in said)
        assert not any("not_built" in m for m in said), said  # it is built: refused, and said so once
        assert rows_digest(a) == _reference_digest(a)  # numpy's serves
    finally:
        os.chmod(library, 0o700)
        native.digest_function.cache_clear()


def test_building_the_c_digest_says_what_went_wrong(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSGUARD_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match="building the row digest failed"):
        native.build_digest(compiler="false")
    assert not native.digest_library().exists() and not list((tmp_path / "ops").glob(".build-*"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(ConfigError, match="no C compiler"):
        native.build_digest()
    native.digest_function.cache_clear()
    assert native.digest_function() is None  # not built: numpy's digest serves
    native.digest_function.cache_clear()


def test_frames_round_trip_and_refuse_damage() -> None:
    arrays = [np.arange(12, dtype=np.float32).reshape(3, 4), np.array([1, 5], dtype=np.int64)]
    frame = encode_frame({"op": "delta", "task": "ps:0"}, arrays)
    header, back = decode_frame(frame)
    assert header["op"] == "delta" and all(np.array_equal(x, y) for x, y in zip(arrays, back, strict=True))
    flipped = bytearray(frame)
    flipped[-3] ^= 0x10
    with pytest.raises(CorruptCheckpointError, match="CRC32"):
        decode_frame(bytes(flipped))
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        decode_frame(frame[:-1])
    with pytest.raises(CorruptCheckpointError, match="magic"):
        decode_frame(b"GARBAGE!" + frame[8:])


def test_a_frame_read_into_an_array_is_checked_like_a_decoded_one() -> None:
    import io

    rows = np.arange(40, dtype=np.float32).reshape(10, 4)
    frame = encode_frame({"status": "ok", "token": "t"}, [rows])
    out = np.zeros_like(rows)
    assert read_frame_into(io.BytesIO(frame), out)["token"] == "t" and np.array_equal(out, rows)
    empty = encode_frame({"status": "mismatch"})
    assert read_frame_into(io.BytesIO(empty), np.zeros_like(rows))["status"] == "mismatch"
    damaged = bytearray(frame)
    damaged[-3] ^= 0xFF
    cases = {
        "CRC32": bytes(damaged),
        "truncated": frame[:-1],
        "after the last array": frame + b"x",
        "magic": b"GARBAGE!" + frame[8:],
    }
    for message, data in cases.items():
        with pytest.raises(CorruptCheckpointError, match=message):
            read_frame_into(io.BytesIO(data), np.zeros_like(rows))
    with pytest.raises(CorruptCheckpointError, match="does not fit"):
        read_frame_into(io.BytesIO(frame), np.zeros((10, 5), np.float32))
    with pytest.raises(CorruptCheckpointError, match="does not fit"):
        read_frame_into(io.BytesIO(frame), np.zeros((10, 4), np.float64))


def test_rows_sent_without_a_crc_are_still_checked_for_shape_and_length() -> None:
    """A fetch's rows come without a CRC (the new agent checks them against the owner's digests, see
    test_peer_copy: a damaged copy is refused); everything else about the frame is still checked."""
    import io

    from psguard.agent.tiers.copy_frames import frame_parts

    rows = np.arange(40, dtype=np.float32).reshape(10, 4)
    frame = b"".join(frame_parts({"status": "ok"}, [rows], crc=False))
    header, back = decode_frame(frame)
    assert header["crc32"] is None and np.array_equal(back[0], rows)
    out = np.zeros_like(rows)
    assert read_frame_into(io.BytesIO(frame), out)["status"] == "ok" and np.array_equal(out, rows)
    for message, data in {"truncated": frame[:-1], "after the last array": frame + b"x"}.items():
        with pytest.raises(CorruptCheckpointError, match=message):
            read_frame_into(io.BytesIO(data), np.zeros_like(rows))
        with pytest.raises(CorruptCheckpointError, match=message.split()[0]):
            decode_frame(data)


def test_a_digest_imports_nothing_more_than_numpy(digest: str) -> None:
    """A replaced node's first fetch hashes every piece on four threads: an import there (numpy.random, once)
    held all four on its lock."""
    code = (
        "import sys, numpy as np\n"
        "from psguard.agent.tiers.copy_frames import rows_digest\n"
        "before = set(sys.modules)\n"
        "rows_digest(np.ones((5, 32), np.float32)); rows_digest(np.ones(7, np.int64))\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout
    code = "from psguard.handoff.native import digest_function; print(digest_function() is not None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == str(digest == "C")  # the child used the digest it was meant to
