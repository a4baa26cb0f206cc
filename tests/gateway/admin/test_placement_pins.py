"""The placement admin API's pins (gateway/admin/placement.py), in process: an operator's typo is refused, not
stored as a pin that applies to no request (and counts as an adapter on its replica in the leader's plan)."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import create_app
from gateway.appkeys import PLACER
from gateway.config import GatewayConfig
from gateway.residency.store import StoreUnavailable
from tests.gateway.admin.test_admin_surface import ADMIN, TOKEN, raw_config


async def test_a_pin_names_a_key_the_pools_requests_are_routed_by(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TENANTGATE_ADMIN_TOKEN", TOKEN)
    raw = raw_config(tmp_path)
    raw["routing"]["home_placement"] = "traffic"
    async with TestClient(TestServer(create_app(GatewayConfig.model_validate(raw)))) as client:
        typo = await client.put("/admin/placement/pins/llama/acmee", json={"replica": "r0"}, headers=ADMIN)
        assert typo.status == 400
        error = (await typo.json())["error"]
        assert error["param"] == "key" and "acmee" in error["message"]
        pinned = await client.put("/admin/placement/pins/llama/acme", json={"replica": "r0"}, headers=ADMIN)
        assert pinned.status == 200 and (await pinned.json())["pinned_to"] == "r0"
        # Unpinning takes any key: a pin left by a tenant since removed can still go.
        gone = await client.delete("/admin/placement/pins/llama/removed-tenant", headers=ADMIN)
        assert gone.status == 200 and (await gone.json())["pinned_to"] is None


async def test_a_pin_or_freeze_shows_at_once_not_at_the_next_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator who pins a key or freezes the plan reads it back from ``GET /admin/placement`` right away (the
    leader applies it at its next interval, 10 s by default; until then the page said "not pinned")."""
    monkeypatch.setenv("TENANTGATE_ADMIN_TOKEN", TOKEN)
    raw = raw_config(tmp_path)
    raw["routing"]["home_placement"] = "traffic"
    async with TestClient(TestServer(create_app(GatewayConfig.model_validate(raw)))) as client:
        before = await (await client.get("/admin/placement", headers=ADMIN)).json()
        assert before["pins"]["llama"] == {} and before["frozen"] is False
        assert (await client.put("/admin/placement/pins/llama/acme", json={"replica": "r0"}, headers=ADMIN)).ok
        assert (await client.post("/admin/placement/freeze", json={"frozen": True}, headers=ADMIN)).ok
        after = await (await client.get("/admin/placement", headers=ADMIN)).json()
        assert after["pins"]["llama"] == {"acme": "r0"} and after["frozen"] is True
        assert (await client.delete("/admin/placement/pins/llama/acme", headers=ADMIN)).ok
        assert (await (await client.get("/admin/placement", headers=ADMIN)).json())["pins"]["llama"] == {}


class _Unreachable:
    """A placement store whose Redis does not answer."""

    async def operator(self) -> None:
        raise StoreUnavailable("redis read failed: ConnectionError()")

    async def set_frozen(self, frozen: bool) -> None:
        raise StoreUnavailable("redis set failed: ConnectionError()")

    async def set_pin(self, pool: str, key: str, replica: str | None) -> None:
        raise StoreUnavailable("redis set failed: ConnectionError()")

    async def close(self) -> None:
        return None


async def test_a_change_the_store_cannot_take_is_a_503_to_retry_not_a_bad_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator's request was right; the shared store is down: 503 with Retry-After, naming why."""
    monkeypatch.setenv("TENANTGATE_ADMIN_TOKEN", TOKEN)
    raw = raw_config(tmp_path)
    raw["routing"]["home_placement"] = "traffic"
    app = create_app(GatewayConfig.model_validate(raw))
    async with TestClient(TestServer(app)) as client:
        monkeypatch.setattr(app[PLACER], "store", _Unreachable())
        answers = [
            await client.put("/admin/placement/pins/llama/acme", json={"replica": "r0"}, headers=ADMIN),
            await client.delete("/admin/placement/pins/llama/acme", headers=ADMIN),
            await client.post("/admin/placement/freeze", json={"frozen": True}, headers=ADMIN),
        ]
        for answer in answers:
            error = (await answer.json())["error"]
            assert answer.status == 503 and answer.headers["Retry-After"] == "5", error
            assert error["code"] == "store_unavailable" and "placement store is unreachable" in error["message"]
        # The table's read says so at once (the interval's poll had still found the store up).
        shown = await (await client.get("/admin/placement", headers=ADMIN)).json()
        assert shown["store"] == "down" and shown["pins"]["llama"] == {}
