"""A warm standby trainer: how it knows it is one, and the one line that tells it to go."""

from __future__ import annotations

import io

from psguard.handoff.standby import GO, STANDBY_ENV, is_standby, wait_for_go


def test_only_the_agents_variable_makes_a_standby() -> None:
    assert not is_standby({})
    assert is_standby({STANDBY_ENV: "1"})


def test_go_releases_it_and_a_closed_pipe_does_not() -> None:
    assert wait_for_go(io.BytesIO(GO))
    assert not wait_for_go(io.BytesIO(b""))
    assert not wait_for_go(io.BytesIO(b"stop\n"))
