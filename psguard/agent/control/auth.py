"""Who may call the agent: bearer credentials and the scopes they grant, ``read`` (``GET /metrics``, ``/status``)
and ``control`` (every POST). :class:`TokenAuth` is the shared ``--token-file`` secret (both scopes);
:class:`JwtAuth` a JWT (HS256 secret or RS256/ES256 public key) with ``exp`` and ``aud`` required and the scopes in
its ``scope`` claim. No credential is ever logged; a refused JWT logs only the kind of failure, at INFO once a
minute per kind: anyone who can reach the port can send bad tokens, and must not fill the log."""

from __future__ import annotations

import hmac
import logging
import math
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from psguard.errors import ConfigError
from psguard.handoff.credentials import read_secret_file

log = logging.getLogger(__name__)

READ = "read"
CONTROL = "control"
SCOPES = frozenset({READ, CONTROL})
MIN_TOKEN_LENGTH = 16
MIN_JWT_SECRET_BYTES = 32  # RFC 7518 section 3.2: an HS256 key at least as long as the hash output
REFUSAL_INFO_EVERY = 60.0  # seconds between INFO lines for one kind of refused JWT


class Authenticator(Protocol):
    """Turns a bearer credential into the scopes it grants (``None``: not accepted by this authenticator)."""

    def scopes(self, credential: str) -> frozenset[str] | None: ...


def check_token(token: str) -> None:
    """A shared token must be long enough to not be guessed, and fit in a header; the message never echoes it."""
    if len(token) < MIN_TOKEN_LENGTH or not token.isascii() or not token.isprintable() or " " in token:
        raise ConfigError(
            f"the agent's HTTP token must be at least {MIN_TOKEN_LENGTH} printable ASCII characters without "
            f"spaces (got {len(token)} characters); generate one with: python -c 'import secrets; "
            f"print(secrets.token_urlsafe(32))'"
        )


class TokenAuth:
    """The shared bearer token: grants ``read`` and ``control``."""

    def __init__(self, token: str) -> None:
        check_token(token)
        self._token = token.encode("ascii")

    def __repr__(self) -> str:
        return "TokenAuth(<hidden>)"

    def scopes(self, credential: str) -> frozenset[str] | None:
        try:
            provided = credential.encode("ascii")
        except UnicodeEncodeError:
            return None
        return SCOPES if hmac.compare_digest(provided, self._token) else None


class JwtAuth:
    """Bearer JWTs signed with ``key``; ``exp`` and ``aud`` required; scopes from the ``scope`` claim."""

    def __init__(self, key: Any, algorithms: Sequence[str], audience: str, *, leeway: float = 0.0) -> None:
        if not audience:
            raise ConfigError(
                "--jwt-audience is required with JWT auth: a token minted for another service must not work here"
            )
        self._key = key
        self.algorithms = list(algorithms)
        self.audience = audience
        self.leeway = leeway
        self._lock = threading.Lock()
        self._logged: dict[str, float] = {}  # kind of refusal -> when last logged at INFO

    def __repr__(self) -> str:
        return f"JwtAuth(algorithms={self.algorithms}, audience={self.audience!r})"

    @classmethod
    def from_secret_file(cls, path: str, audience: str) -> JwtAuth:
        """HS256 with the shared secret in ``path`` (a private file, at least 32 bytes)."""
        secret = read_secret_file(path, "--jwt-secret-file")
        if len(secret.encode("utf-8")) < MIN_JWT_SECRET_BYTES:
            raise ConfigError(
                f"--jwt-secret-file {path}: an HS256 secret needs at least {MIN_JWT_SECRET_BYTES} bytes "
                f"(python -c 'import secrets; print(secrets.token_urlsafe(48))')"
            )
        return cls(secret.encode("utf-8"), ["HS256"], audience)

    @classmethod
    def from_public_key_file(cls, path: str, audience: str) -> JwtAuth:
        """RS256 (an RSA key) or ES256 (an EC P-256 key) from a PEM public key; the algorithm follows the key."""
        # Here, not at the top: PyJWT and cryptography cost every agent ~50 ms of its start (a replaced node's
        # agent is on the recovery's path), and only agents given JWT settings use them.
        from cryptography.hazmat.primitives.asymmetric import ec, rsa
        from cryptography.hazmat.primitives.serialization import load_pem_public_key

        try:
            with open(path, "rb") as f:
                key = load_pem_public_key(f.read())
        except (OSError, ValueError) as e:
            raise ConfigError(f"--jwt-public-key {path}: not a readable PEM public key ({type(e).__name__})") from None
        if isinstance(key, rsa.RSAPublicKey):
            algorithms = ["RS256"]
        elif isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1):
            algorithms = ["ES256"]
        else:
            raise ConfigError(f"--jwt-public-key {path}: expected an RSA or EC P-256 public key")
        return cls(key, algorithms, audience)

    def scopes(self, credential: str) -> frozenset[str] | None:
        if credential.count(".") != 2:
            return None  # not a JWT: another authenticator's credential
        import jwt  # lazy: see from_public_key_file

        try:
            claims = jwt.decode(
                credential,
                self._key,
                algorithms=self.algorithms,
                audience=self.audience,
                leeway=self.leeway,
                options={"require": ["exp", "aud"]},
            )
        except jwt.InvalidTokenError as e:
            self._log_refusal(type(e).__name__)
            return None
        scope = claims.get("scope", "")
        names = scope.split() if isinstance(scope, str) else [str(s) for s in scope] if isinstance(scope, list) else []
        return frozenset(names) & SCOPES

    def _log_refusal(self, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            info = now - self._logged.get(reason, -math.inf) >= REFUSAL_INFO_EVERY
            if info:
                self._logged[reason] = now
        log.log(logging.INFO if info else logging.DEBUG, "event=jwt_refused reason=%s", reason)
