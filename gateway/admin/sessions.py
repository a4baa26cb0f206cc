"""Status-page sessions that any gateway accepts: the cookie is the session, signed, not a key into one pod's memory.

Behind a Service, a browser's next request may reach another gateway pod, and an autoscaler adds and removes pods;
a session kept in the memory of the pod that logged in would be lost on every other one. So the cookie carries the
session itself (an id and the page's CSRF token) with its time of issue, signed with itsdangerous
(HMAC-SHA256) under a key every gateway holds: ``TENANTGATE_SESSION_KEY`` from the environment (a Kubernetes
Secret), else a key derived from the admin token, which every gateway of a deployment already shares. A cookie
whose signature does not verify, or older than ``SESSION_S``, is no session.

Logging out clears the cookie, and the gateway that served the logout refuses that session from then on; another
gateway accepts a copy of the cookie until it expires (to end every session at once, change the key).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from itsdangerous import BadData, TimestampSigner, URLSafeTimedSerializer

from gateway.config import ConfigError
from gateway.tenants.signing import derived_key

SESSION_KEY_ENV = "TENANTGATE_SESSION_KEY"
SESSION_S = 8 * 3600
MIN_KEY_CHARS = 32
_SALT = "tenantgate status page session"


@dataclass(frozen=True)
class Session:
    sid: str
    csrf: str


def session_key(admin_token: str, environ: Mapping[str, str]) -> bytes | None:
    """The signing key: ``TENANTGATE_SESSION_KEY`` (at least 32 characters, else ``ConfigError``), else one derived
    from the admin token; None without either (then no session exists: the admin API is off)."""
    explicit = environ.get(SESSION_KEY_ENV, "")
    if explicit:
        if len(explicit) < MIN_KEY_CHARS:
            raise ConfigError(
                SESSION_KEY_ENV,
                [f"{SESSION_KEY_ENV} is shorter than {MIN_KEY_CHARS} characters: the status page's sessions would "
                 "be forgeable"],
            )  # fmt: skip
        return explicit.encode()
    if admin_token:
        return derived_key(admin_token, _SALT.encode())
    return None


class SessionSigner:
    """Issues and reads signed session cookies; remembers the sessions logged out here until they would expire.
    ``clock`` (unix seconds) is injectable so expiry is tested without waiting."""

    def __init__(
        self, key: bytes | None, *, max_age_s: int = SESSION_S, clock: Callable[[], float] = time.time
    ) -> None:
        """``key`` None (no admin token, no session key): no cookie is ever a session, and none is issued."""

        class _Signer(TimestampSigner):
            def get_timestamp(self) -> int:
                return int(clock())

        self._serializer = None if key is None else URLSafeTimedSerializer(key, salt=_SALT, signer=_Signer)
        self._max_age_s, self._clock = max_age_s, clock
        self._logged_out: dict[str, float] = {}  # sid -> when its cookie expires anyway

    def issue(self) -> tuple[str, Session]:
        if self._serializer is None:
            raise RuntimeError("no session key: the admin API is off")
        session = Session(secrets.token_urlsafe(16), secrets.token_urlsafe(32))
        return self._serializer.dumps({"sid": session.sid, "csrf": session.csrf}), session

    def read(self, cookie: str) -> Session | None:
        """The cookie's session, or None: absent, forged, tampered with, expired or logged out here."""
        if not cookie or self._serializer is None:
            return None
        try:
            data: Any = self._serializer.loads(cookie, max_age=self._max_age_s)
        except BadData:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("sid"), str) or not isinstance(data.get("csrf"), str):
            return None
        if data["sid"] in self._logged_out:
            return None
        return Session(data["sid"], data["csrf"])

    def log_out(self, session: Session) -> None:
        now = self._clock()
        self._logged_out = {sid: until for sid, until in self._logged_out.items() if until > now}
        self._logged_out[session.sid] = now + self._max_age_s
