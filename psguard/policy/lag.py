"""How far the durable log may trail the durable cadence: the rule that keeps psguard never worse than TF's saver.

TF's saver is synchronous; psguard's durable write runs in the background, so a store slower than the cadence lets
training run ahead of what is durable. The *durable lag* is measured from the oldest capture due for the durable
tier and not committed yet (``steps`` trained past it, ``seconds`` waiting). :class:`LagBound` says what to do
when it grows past ``max_steps`` (or ``max_seconds``):

- ``hold``: training waits at its next save decision until the commit lands, so a fault loses at most
  ``max_steps`` steps more than TF's saver at the same cadence (the default, ``max_steps: 0``, waits at the save
  itself, as TF's saver does). A store that fails ends the wait: the memory tier keeps every save restorable
  meanwhile, and the lag is reported until the store takes a commit again.
- ``report``: training never waits; the lag is reported (``/status``, ``/metrics``, the shipped alert).

Policy files set it under ``durable_lag:``; ``psguard policy check`` prints it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

from psguard.config import Check, Duration, format_duration, invalid, validate

__all__ = ["LagBound"]

_NON_NEGATIVE = Check(lambda v: v >= 0, "(>= 0)")


@dataclass(frozen=True)
class LagBound:
    """The durable lag a job accepts, and what happens past it (see the module doc).

    ``max_steps``: steps training may run past a capture that is due for the durable tier and not committed
    (``None``: no step bound); ``max_seconds``: how long such a capture may wait (``None``: no time bound)."""

    max_steps: Annotated[int, _NON_NEGATIVE] | None = 0
    max_seconds: Duration | None = None
    on_exceed: Literal["hold", "report"] = "hold"

    def __post_init__(self) -> None:
        validate(self)
        if self.max_seconds is not None and not (math.isfinite(self.max_seconds) and self.max_seconds >= 0):
            raise invalid("max_seconds", "a finite duration >= 0", self.max_seconds)
        if self.max_steps is None and self.max_seconds is None:
            raise invalid("max_steps", "a bound: max_steps, max_seconds or both (on_exceed: report never waits)", None)

    @property
    def holds(self) -> bool:
        """Whether training ever waits for the durable log under this bound."""
        return self.on_exceed == "hold"

    def exceeded(self, next_steps: int, seconds: float) -> bool:
        """Whether letting one more step run would put the lag past the bound.

        ``next_steps``: how many steps past the oldest pending capture training would be after its next step
        (1 at the save itself), ``seconds``: how long that capture has waited. With ``max_steps: 0`` the first
        step after the save is already past, so the wait happens at the save, as TF's does."""
        if self.max_steps is not None and next_steps > self.max_steps:
            return True
        return self.max_seconds is not None and seconds > self.max_seconds

    def describe(self) -> str:
        """The rule in words, for ``psguard policy check`` and status pages."""
        bounds = (
            self.max_steps is not None and f"{self.max_steps} step(s)",
            self.max_seconds is not None and format_duration(self.max_seconds),
        )
        limit = " or ".join(b for b in bounds if b)
        if self.on_exceed == "report":
            return f"report a durable lag past {limit}; never wait"
        if self.max_steps == 0 and self.max_seconds is None:
            return "wait at each durable save until it is committed (as TF's saver), unless the store fails"
        return f"wait for the durable log when it trails by more than {limit}, unless the store fails"
