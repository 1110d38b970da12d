"""The peer copies' settings (``peer_copy:`` in a PS agent's config), apart from the code that sends them.

Apart because the agent's config loads them in every agent, and the copies' code loads numpy, which a worker's
agent never needs (it starts faster without).
"""

from __future__ import annotations

from dataclasses import dataclass

from psguard.config import Duration

__all__ = ["PeerCopyConfig"]


@dataclass(frozen=True)
class PeerCopyConfig:
    """``peer_copy:`` (a PS agent): how its copy reaches the peer that holds it (``peers.copies`` of the
    chief's agent turns the copies on and places them)."""

    max_queue_mb: int = 256  # deltas waiting to be sent; past it they are dropped and the next send is whole
    max_mb_per_s: float = 0.0  # the bandwidth the copies may take (0: no limit)
    # Bytes per request of a whole copy, and of a fetch by a new agent: what each request holds in memory on both
    # sides (at 32 MB and 4 streams the 1 GB node-loss bench saw a holder grow by 2.1x the copy, not 1.1x).
    chunk_mb: int = 8
    fetch_streams: int = 4  # requests in flight when a new agent fetches its copy (each checked on its own thread)
    request_timeout: Duration = 60.0
    retry_after: Duration = 1.0  # after a failed send (the holder down): wait, then send the whole state
    # A capture: its apply answers once the holder has it too, up to this long (0: never waits), so that the
    # state the chief's tier moves to is held by the copies as well (a copy one capture behind cannot serve a
    # restore). The trainer does not wait for it: only the capture's acknowledgement does. A whole copy is
    # waited for as long, so a large state's first capture is acknowledged this much later.
    wait_for_copy: Duration = 5.0
    # A full copy also holds the rows' fingerprints the captures computed (8 bytes a row: 1/16 of a row of 32
    # float32), so a PS restored from it loads them instead of hashing every row on the replaced node (0.3 CPU-s
    # a 512 MB shard). Off: the copy costs the rows alone, and that restore hashes. Parity blocks never hold them.
    fingerprints: bool = True
