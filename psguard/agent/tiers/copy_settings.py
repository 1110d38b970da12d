"""The peer copies' settings (``peer_copy:`` in a PS agent's config), apart from the code that sends them: every
agent loads its config, and the copies' code loads numpy, which a worker's agent never needs."""

from __future__ import annotations

from dataclasses import dataclass

from psguard.config import Duration


@dataclass(frozen=True)
class PeerCopyConfig:
    """``peer_copy:`` (a PS agent): how its copy reaches the peer that holds it (``peers.copies`` of the
    chief's agent turns the copies on and places them)."""

    max_queue_mb: int = 256  # deltas waiting to be sent; past it they are dropped and the next send is whole
    max_mb_per_s: float = 0.0  # the bandwidth the copies may take (0: no limit)
    chunk_mb: int = 8  # per request of a whole copy or a fetch: what each holds in memory on both sides
    fetch_streams: int = 4  # requests in flight when a new agent fetches its copy (each checked on its own thread)
    request_timeout: Duration = 60.0
    retry_after: Duration = 1.0  # after a failed send (the holder down): wait, then send the whole state
    # A capture's apply answers once the holder has it too, up to this long (0: never waits), so that the state
    # the chief's tier moves to is held by the copy as well; the trainer waits for the acknowledgement only.
    wait_for_copy: Duration = 5.0
    # A full copy also holds the rows' fingerprints (8 bytes a row), so a PS restored from it need not hash them.
    fingerprints: bool = True
