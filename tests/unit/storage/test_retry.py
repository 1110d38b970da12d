"""Which failures the retry layer tries again: an HTTP answer is judged by its status, whatever client gave it."""

from __future__ import annotations

import pytest
from gcsfs.retry import HttpError

from psguard.errors import StorageError
from psguard.storage import RetryConfig
from psguard.storage.base import Backend, Buffer
from psguard.storage.retry import RetryingBackend, is_transient


class AnswersThenServes(Backend):
    """Answers the first ``n`` gets with ``error`` (an HTTP client's exception), then serves."""

    url = "memory://answers"

    def __init__(self, error: Exception, n: int) -> None:
        self.error, self.left, self.calls = error, n, 0

    def get(self, key: str) -> bytes:
        self.calls += 1
        if self.left:
            self.left -= 1
            raise self.error
        return b"value"

    def put(self, key: str, data: Buffer) -> None:
        raise NotImplementedError

    def put_new(self, key: str, data: Buffer) -> None:
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def keys(self, prefix: str) -> list[str]:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError


FAST = RetryConfig(deadline=10, initial_backoff=0.01, max_backoff=0.02)


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504])
def test_an_answer_to_try_again_later_is_retried(status: int) -> None:
    """429 (rate limit) and 5xx are GCS's "try again"; gcsfs raises them as an HttpError carrying the code."""
    error = HttpError({"code": status, "message": "Please try again."})
    assert is_transient(error)
    backend = AnswersThenServes(error, 2)
    assert RetryingBackend(backend, FAST).get("k") == b"value"
    assert backend.calls == 3


SAFE_MODE = (
    'RPCError("org.apache.hadoop.hdfs.server.namenode.SafeModeException", "Cannot create directory /job/locks. Name '
    "node is in safe mode.\\nThe reported blocks 0 needs additional 43 blocks to reach the threshold 0.9990 of total "
    'blocks 43.")'
)


def test_a_namenode_in_safe_mode_is_waited_for_and_a_refusal_is_not() -> None:
    """For seconds after every start a NameNode refuses writes in safe mode; hdfs-native raises that as a
    RuntimeError naming Hadoop's exception. It failed a durable save at once right after an HDFS outage (explore
    seed 23 case 6), and the trainer's close() then raised: a restart and lost steps plain TF did not have."""
    error = RuntimeError(SAFE_MODE)
    assert is_transient(error)
    backend = AnswersThenServes(error, 2)
    assert RetryingBackend(backend, FAST).get("k") == b"value"
    assert backend.calls == 3
    denied = RuntimeError('RPCError("org.apache.hadoop.security.AccessControlException", "Permission denied")')
    assert not is_transient(denied)
    assert not is_transient(RuntimeError("SafeModeException in a message that is not Hadoop's"))


@pytest.mark.parametrize("status", [400, 401, 403, 409])
def test_an_answer_retrying_cannot_change_fails_at_once(status: int) -> None:
    error = HttpError({"code": status, "message": "no"})
    assert not is_transient(error)
    backend = AnswersThenServes(error, 1)
    with pytest.raises(StorageError, match=f"get 'k' on memory://answers failed: HttpError: no, {status}"):
        RetryingBackend(backend, FAST).get("k")
    assert backend.calls == 1


class Explains(AnswersThenServes):
    def explain(self, error: BaseException) -> str | None:
        return f"the store says: {error}"


def test_the_retry_layer_explains_a_failure_as_its_backend_does() -> None:
    """A caller holding the retrying backend (the storage wait's message) gets the backend's explanation."""
    error = HttpError({"code": 403, "message": "denied"})
    assert RetryingBackend(Explains(error, 0), FAST).explain(error) == f"the store says: {error}"
