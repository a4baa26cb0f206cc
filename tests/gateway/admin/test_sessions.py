"""Status-page sessions any gateway accepts (gateway/admin/sessions.py): the signer alone on a fake clock, then two
`tenantgate serve` processes sharing an admin token, where a session made on one works on the other."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from gateway.admin.sessions import SESSION_KEY_ENV, SESSION_S, SessionSigner, session_key
from gateway.config import ConfigError
from loadtests.faultkit import GatewayUnderTest, sim_replicas
from loadtests.fleet import ADMIN_TOKEN, gateway_config, write_adapters
from loadtests.processes import free_port

KEY = b"k" * 16 + b"e" * 16


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_session_made_by_one_signer_is_read_by_another_with_the_same_key_only() -> None:
    cookie, session = SessionSigner(KEY).issue()
    assert SessionSigner(KEY).read(cookie) == session  # another gateway, the same key
    assert SessionSigner(b"x" * 32).read(cookie) is None  # another key
    assert SessionSigner(None).read(cookie) is None  # no key: no sessions at all
    with pytest.raises(RuntimeError):
        SessionSigner(None).issue()


@pytest.mark.parametrize(
    "tamper",
    [
        # The signature's first character: all six of its bits count (the last one's low bits are padding).
        pytest.param(
            lambda c: c[: c.rindex(".") + 1] + ("B" if c[c.rindex(".") + 1] == "A" else "A") + c[c.rindex(".") + 2 :],
            id="signature changed",
        ),
        pytest.param(lambda c: "x" + c, id="payload changed"),
        pytest.param(lambda c: c.split(".")[0], id="signature removed"),
        pytest.param(lambda c: "", id="empty"),
        pytest.param(lambda c: "not-a-session", id="garbage"),
    ],
)
def test_a_tampered_cookie_is_no_session(tamper: object) -> None:
    assert callable(tamper)
    cookie, _ = SessionSigner(KEY).issue()
    assert SessionSigner(KEY).read(tamper(cookie)) is None


def test_a_session_expires_after_eight_hours_and_a_logout_ends_it_here() -> None:
    clock = Clock()
    signer = SessionSigner(KEY, clock=clock)
    cookie, session = signer.issue()
    clock.now += SESSION_S
    assert signer.read(cookie) == session  # to the second
    clock.now += 1
    assert signer.read(cookie) is None
    clock.now -= 2
    signer.log_out(session)
    assert signer.read(cookie) is None
    fresh_cookie, fresh = signer.issue()
    assert signer.read(fresh_cookie) == fresh  # only that session ended


def test_the_key_comes_from_the_environment_or_the_admin_token() -> None:
    explicit = "s" * 16 + "e" * 16
    assert session_key("admin-token", {SESSION_KEY_ENV: explicit}) == explicit.encode()
    derived = session_key("a" * 40, {})
    assert derived is not None and derived == session_key("a" * 40, {}) != session_key("b" * 40, {})
    assert derived != b"a" * 40  # derived, not the token itself
    assert session_key("", {}) is None
    with pytest.raises(ConfigError, match=SESSION_KEY_ENV):
        session_key("a" * 40, {SESSION_KEY_ENV: "short"})


def test_a_status_page_session_made_on_one_gateway_works_on_another(tmp_path: Path) -> None:
    """Two gateways with the same admin token, as pods behind one Service: log in on one, then the other shows the
    page (not the login form) with the same CSRF token, serves /admin/state and takes a page action; a gateway with
    another TENANTGATE_SESSION_KEY refuses the cookie."""
    tenants = {"acme": ["lora-a"]}
    with sim_replicas(tmp_path, 1, "--time-scale", "0.01") as replicas:
        adapters = write_adapters(tmp_path, ["lora-a"])
        urls = {name: replica.url for name, replica in replicas.items()}
        gateways = [GatewayUnderTest(tmp_path, gateway_config(urls, tenants, adapters, port=free_port()), name=n)
                    for n in ("a", "b", "c")]  # fmt: skip
        gateways[2].env = {**gateways[2].env, SESSION_KEY_ENV: "another-key-" + "z" * 24}
        try:
            for gw in gateways:
                gw.start()
            first, second, third = (gw.url for gw in gateways)
            login = httpx.post(first + "/admin/ui/login", data={"token": ADMIN_TOKEN})
            assert login.status_code == 303, login.text
            cookies = {"tenantgate_session": login.cookies["tenantgate_session"]}
            page_a = httpx.get(first + "/admin/ui", cookies=cookies).text
            page_b = httpx.get(second + "/admin/ui", cookies=cookies).text
            state_b = httpx.get(second + "/admin/state", cookies=cookies)
            csrf = re.search(r'name="csrf-token" content="([^"]+)"', page_b)
            assert csrf is not None, page_b[:500]
            action = {"pool": "llama", "replica": "r0"}
            drained = httpx.post(
                second + "/admin/ui/actions/drain",
                cookies=cookies,
                headers={"X-CSRF-Token": csrf.group(1)},
                json=action,
            )
            page_c = httpx.get(third + "/admin/ui", cookies=cookies).text
            state_c = httpx.get(third + "/admin/state", cookies=cookies)
        finally:
            for gw in gateways:
                gw.stop()
    assert csrf.group(1) in page_a  # the same session on both
    assert state_b.status_code == 200 and state_b.json()["pools"]
    assert drained.status_code == 200 and drained.json()["drained"] is True, drained.text
    assert 'name="token"' in page_c and "csrf-token" not in page_c  # the login form: not a session there
    assert state_c.status_code == 401
