"""The fsspec backends' shared parts: modification times as each filesystem reports them."""

from __future__ import annotations

import datetime as dt

import pytest

from psguard.storage.fsspec_backend import info_mtime

WHEN = dt.datetime(2024, 5, 1, 12, 0, 0, tzinfo=dt.UTC)


@pytest.mark.parametrize(
    "info",
    [
        {"LastModified": WHEN},  # s3fs
        {"LastModified": WHEN.replace(tzinfo=None)},  # a naive datetime is UTC
        {"last_modified": "2024-05-01T12:00:00Z"},
        {"modification_time": int(WHEN.timestamp() * 1000)},  # hdfs-native, milliseconds
        {"modificationTime": WHEN.timestamp() * 1000},  # WebHDFS, milliseconds
        {"mtime": WHEN.timestamp()},  # local, seconds
        {"mtime": WHEN, "updated": "2024-05-01T12:00:00.000Z"},  # gcsfs: a datetime, and GCS's own field
        {"updated": "2024-05-01T12:00:00.000Z"},  # the GCS JSON API's object resource
    ],
)
def test_every_filesystems_mtime_is_seconds_since_the_epoch(info: dict[str, object]) -> None:
    assert info_mtime(info) == WHEN.timestamp()


@pytest.mark.parametrize("info", [{}, {"LastModified": "yesterday"}, {"modification_time": True}, {"mtime": "1"}])
def test_no_usable_time_is_none(info: dict[str, object]) -> None:
    assert info_mtime(info) is None
