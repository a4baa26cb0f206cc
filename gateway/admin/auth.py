"""The admin API's door: off unless a token is set, then Bearer-authenticated in constant time.

serve refuses to start with a weak token (``admin_token``) unless ``admin.allow_weak_token`` says this is a local
setup. Failed logins are limited per source address (``FailedLogins``): past ``admin.failed_logins_per_minute`` an
address gets 429 before its token is even compared, so guessing runs at that rate, not at the gateway's speed.
"""

from __future__ import annotations

import hmac
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from aiohttp import web

from gateway.appkeys import ADMIN_TOKEN, METRICS, STATE
from gateway.config import AdminConfig, ConfigError
from gateway.errors import AdminDisabled, AuthenticationFailed, RequestRateLimited
from gateway.serving.connections import authenticated
from gateway.tenants.admission import Bucket
from gateway.tenants.directory import sent_bytes
from gateway.tenants.identity import bearer, within

MIN_TOKEN_CHARS = 32
# Placeholders that ship in examples, or that people type first.
KNOWN_DEFAULTS = frozenset({"change-me", "changeme", "admin", "admin-secret", "secret", "password", "token", "test"})


def admin_token(admin: AdminConfig, environ: Mapping[str, str]) -> str:
    """The admin token from the environment ("" leaves the admin API off); ``ConfigError`` if it is weak and the
    config does not allow that."""
    return _strong(admin, admin.token_env, environ.get(admin.token_env, ""), "admin")


def metrics_token(admin: AdminConfig, environ: Mapping[str, str]) -> str:
    """The read-only token for /metrics on the tenant port ("": only the admin token reads it), held to the admin
    token's strength."""
    return _strong(admin, admin.metrics_token_env, environ.get(admin.metrics_token_env, ""), "metrics")


def _strong(admin: AdminConfig, env: str, token: str, what: str) -> str:
    if not token or admin.allow_weak_token:
        return token
    problem = None
    if token.lower() in KNOWN_DEFAULTS:
        problem = "is a known default"
    elif len(token) < MIN_TOKEN_CHARS:
        problem = f"is shorter than {MIN_TOKEN_CHARS} characters"
    elif len(set(token)) < 8:
        problem = "has fewer than 8 distinct characters"
    if problem is None:
        return token
    raise ConfigError(
        env,
        [
            f"the {what} token {problem}: set a strong one (e.g. `openssl rand -hex 32`), or admin.allow_weak_token: "
            "true for a local setup on loopback only"
        ],
    )


class FailedLogins:
    """Failed admin logins per source address: a bucket of ``per_minute`` failures each, refilled continuously;
    an address whose bucket is empty is refused until it refills. At most ``max_addresses`` are remembered (the
    least recently failed are forgotten first), so a flood of addresses cannot grow memory."""

    def __init__(
        self, per_minute: int, clock: Callable[[], float] = time.monotonic, max_addresses: int = 10_000
    ) -> None:
        self._per_minute, self._clock, self._max = per_minute, clock, max_addresses
        self._buckets: OrderedDict[str, Bucket] = OrderedDict()
        self._blocked_until: dict[str, float] = {}

    def check(self, address: str) -> None:
        """Refuse an address that has failed too often lately (429, with when to try again)."""
        until = self._blocked_until.get(address)
        if until is None:
            return
        wait = until - self._clock()
        if wait <= 0:
            del self._blocked_until[address]
            return
        raise RequestRateLimited(
            "Too many failed admin logins from this address; try again later.",
            headers={"Retry-After": str(math.ceil(wait))},
        )

    def failed(self, address: str) -> None:
        bucket = self._buckets.pop(address, None) or Bucket(self._per_minute, self._per_minute / 60, self._clock)
        self._buckets[address] = bucket  # most recent last
        while len(self._buckets) > self._max:
            forgotten, _ = self._buckets.popitem(last=False)
            self._blocked_until.pop(forgotten, None)
        wait = bucket.take(1)
        if not wait and bucket.tokens < 1:  # that was the last one: the next try waits for one to refill
            wait = (1 - bucket.tokens) / bucket.per_s
        if wait:
            self._blocked_until[address] = self._clock() + wait


FAILED_LOGINS = web.AppKey("failed_admin_logins", FailedLogins)


def source_address(request: web.Request) -> str:
    """Who is logging in: the peer, or behind ``admin.trusted_proxies`` the last address in X-Forwarded-For that
    is not one of them (a client can write what it likes to the left of its proxy's entry)."""
    peer = request.remote or ""
    proxies = request.app[STATE].config.admin.trusted_proxies
    if not proxies or not within(peer, proxies):
        return peer
    hops = [hop.strip() for value in request.headers.getall("X-Forwarded-For", []) for hop in value.split(",")]
    for hop in reversed(hops):
        if hop and not within(hop, proxies):
            return hop
    return peer


def login_allowed(request: web.Request) -> str:
    """The source address, once it is allowed to try (429 if it failed too often)."""
    address = source_address(request)
    try:
        request.app[FAILED_LOGINS].check(address)
    except RequestRateLimited:
        request.app[METRICS].admin_login_failures.labels("rate_limited").inc()
        raise
    return address


def login_failed(request: web.Request, address: str) -> None:
    request.app[METRICS].admin_login_failures.labels("wrong_token").inc()
    request.app[FAILED_LOGINS].failed(address)


def same_token(presented: str, expected: str) -> bool:
    """In constant time. compare_digest refuses a str with non-ASCII characters: bytes, then, as sent."""
    return hmac.compare_digest(sent_bytes(presented), expected.encode())


def require_bearer(request: web.Request, tokens: Sequence[str], refusal: str) -> None:
    """The request's Bearer credential is one of ``tokens`` (none empty), else ``AuthenticationFailed(refusal)``
    and a failed login for its source address (429 first if that address failed too often)."""
    address = login_allowed(request)
    presented = bearer(request.headers.get("Authorization"))
    # Every token is compared (constant time each), so the answer's timing does not say which one nearly matched.
    matches = [same_token(presented or "", token) for token in tokens]
    if presented is None or not any(matches):
        login_failed(request, address)
        raise AuthenticationFailed(refusal)


def require_admin(request: web.Request) -> None:
    token = request.app[ADMIN_TOKEN]
    if not token:
        raise AdminDisabled("The admin API is disabled: no admin token is configured.")
    require_bearer(request, [token], "A valid admin token is required.")
    authenticated(request)  # its connection is no longer one of the unauthenticated the listener caps
