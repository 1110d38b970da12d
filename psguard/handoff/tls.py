"""TLS for the agents' HTTP: the server's context, and the client's (agent to agent, trainer to agent).

The standard library's ``ssl`` with its secure defaults (TLS 1.2 at least, certificate and host name verification).
With ``--tls-ca`` the server requires a client certificate signed by it for all but ``/healthz`` and ``/readyz``
(kubelet probes present none). A trainer finds its files through the environment its agent sets
(``PSGUARD_AGENT_CA``, ``PSGUARD_AGENT_CLIENT_CERT``, ``PSGUARD_AGENT_CLIENT_KEY``); every private key file must be
private (:func:`psguard.handoff.credentials.check_private_file`).
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping

from psguard.errors import ConfigError
from psguard.handoff.contract import ENV_AGENT_CA, ENV_AGENT_CLIENT_CERT, ENV_AGENT_CLIENT_KEY
from psguard.handoff.credentials import check_private_file


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str, what: str) -> None:
    check_private_file(key, f"{what} key")
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"{what}: cannot load the certificate {cert} with its key {key}: {e}") from None


def server_context(cert: str, key: str, ca: str | None = None) -> ssl.SSLContext:
    """HTTPS with ``cert``/``key``; with ``ca``, clients must present a certificate signed by it (mTLS) for
    every path but the open health checks (:class:`psguard.agent.control.httpd.AgentHTTPServer` enforces that)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, cert, key, "--tls-cert/--tls-key")
    if ca is not None:
        try:
            ctx.load_verify_locations(cafile=ca)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"--tls-ca {ca}: cannot load: {e}") from None
        # OPTIONAL, not REQUIRED: a certificate a client presents must verify against the CA (else the handshake
        # fails), and the server refuses every path but /healthz and /readyz to a client without one. A kubelet
        # probe cannot present a certificate, so REQUIRED would fail every pod's probes.
        ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def client_context(ca: str | None = None, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """Verify the server against ``ca`` (else the system store); present ``cert``/``key`` when given."""
    try:
        ctx = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"CA file {ca}: cannot load: {e}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if (cert is None) != (key is None):
        raise ConfigError("a client certificate needs both its certificate and its key file")
    if cert is not None and key is not None:
        _load_chain(ctx, cert, key, "client certificate")
    return ctx


def client_context_from_env(env: Mapping[str, str] | None = None) -> ssl.SSLContext | None:
    """The trainer's context from its agent's environment; ``None`` when the agent set no TLS variables."""
    env = os.environ if env is None else env
    ca, cert, key = env.get(ENV_AGENT_CA), env.get(ENV_AGENT_CLIENT_CERT), env.get(ENV_AGENT_CLIENT_KEY)
    return client_context(ca or None, cert or None, key or None) if ca or cert or key else None
