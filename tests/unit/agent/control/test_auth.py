"""Who may call the agent: what a refused credential leaves in the log."""

from __future__ import annotations

import logging

import pytest

from psguard.agent.control import auth
from psguard.agent.control.auth import JwtAuth

SECRET = b"jwt-hs256-secret-with-at-least-32-bytes!!"


def test_refused_jwts_cannot_fill_the_log(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Anyone who reaches the port can send bad tokens: was one INFO line each."""
    caplog.set_level(logging.DEBUG, logger="psguard.agent.control.auth")
    jwt_auth = JwtAuth(SECRET, ["HS256"], "psguard-agents")
    for _ in range(100):
        assert jwt_auth.scopes("not.a.jwt") is None
        assert jwt_auth.scopes("eyJhbGciOiJIUzI1NiJ9.e30.c2lnbmF0dXJl") is None
    info = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert info == ["event=jwt_refused reason=DecodeError", "event=jwt_refused reason=InvalidSignatureError"]
    assert len([r for r in caplog.records if r.levelno == logging.DEBUG]) == 198  # each one still at DEBUG
    monkeypatch.setattr(auth, "REFUSAL_INFO_EVERY", 0.0)
    assert jwt_auth.scopes("not.a.jwt") is None
    assert caplog.records[-1].levelno == logging.INFO  # once the minute has passed: INFO again
