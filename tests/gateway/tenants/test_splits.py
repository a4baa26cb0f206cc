"""A/B splits: a tenant-facing name served by weighted variants, sticky per end user."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.config import ConfigError, GatewayConfig, parse_config
from gateway.tenants.directory import TenantDirectory
from loadtests.fleet import ADMIN_TOKEN, api_key, fleet_with_gateway, gateway_config

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

ADAPTERS = {"support-a": "/srv/a", "support-b": "/srv/b"}
SPLIT = {"name": "support", "variants": [{"model": "support-a", "weight": 30}, {"model": "support-b", "weight": 70}]}


def config(**changes: Any) -> GatewayConfig:
    raw = gateway_config(
        {"r0": "http://127.0.0.1:1"}, {"acme": ["support"]}, ADAPTERS, port=0, extra={"splits": [SPLIT]}
    )
    return GatewayConfig.model_validate({**raw, **changes})


def test_a_30_70_split_over_10000_users_is_within_2_percent_and_stable() -> None:
    directory = TenantDirectory(config())
    acme = directory.tenant("acme")
    assert acme is not None
    target = directory.resolve(acme, "support")
    users = [f"user-{i}" for i in range(10_000)]
    first = {user: target.pick("acme", user).model for user in users}
    share = Counter(first.values())["support-a"] / len(users)
    assert abs(share - 0.30) <= 0.02, share
    assert all(target.pick("acme", user).model == first[user] for user in users[:2000])  # the same user, same variant


def test_splits_are_validated_like_the_rest_of_the_config() -> None:
    raw = gateway_config({"r0": "http://127.0.0.1:1"}, {"acme": ["support"]}, ADAPTERS, port=0)
    bad = {
        **raw,
        "splits": [
            {"name": "support", "variants": [{"model": "nope", "weight": 1}, {"model": "support-a", "weight": 1}]}
        ],
    }
    with pytest.raises(ConfigError, match="unknown model 'nope'"):
        parse_config(yaml.safe_dump(bad))


def test_each_response_names_its_variant_and_users_stay_on_theirs(tmp_path: Path) -> None:
    tenants = {"acme": ["support-a", "support-b"]}
    with fleet_with_gateway(tmp_path, tenants, 1, ["--time-scale", "0"], extra={"splits": [SPLIT]},
                            tenant_options={"acme": {"adapters": ["support"]}}) as fleet:  # fmt: skip
        seen: dict[str, set[str]] = {}
        for user in [f"u{i}" for i in range(20)]:
            for _ in range(3):
                body = {"model": "support", "prompt": "hi", "max_tokens": 2, "user": user}
                answer = httpx.post(fleet.gateway_url + "/v1/completions", json=body,
                                    headers={"Authorization": f"Bearer {api_key('acme')}"})  # fmt: skip
                assert answer.status_code == 200, answer.text
                seen.setdefault(user, set()).add(answer.headers["x-tenantgate-variant"])
        metrics = httpx.get(fleet.gateway_url + "/metrics", headers=ADMIN).text
    assert all(len(variants) == 1 for variants in seen.values())  # sticky per user
    assert {v for variants in seen.values() for v in variants} == {"support-a", "support-b"}
    assert 'adapter="support-a"' in metrics and 'adapter="support-b"' in metrics  # labelled by variant


def test_a_session_id_header_of_bytes_that_are_not_utf8_routes_like_any_other() -> None:
    """aiohttp hands a header's bytes that are not UTF-8 on as lone surrogates (``b"\\xff"`` is ``"\\udcff"``), which
    ``str.encode`` refuses: an x-session-id of such bytes raised UnicodeEncodeError out of the variant's pick and the
    session's ring key, a 500 and a traceback for any client under a split or routing.affinity: session. The id's
    bytes are hashed as they came: the same bytes, the same variant and key; other ids as before."""
    directory = TenantDirectory(config(routing={"affinity": "session"}))
    acme = directory.tenant("acme")
    assert acme is not None
    raw = "\udcff\udcfeab"  # aiohttp's reading of the header bytes ff fe 61 62
    routed = [directory.route(acme, "support", raw, config().routing.model_copy(update={"affinity": "session"}))]
    routed.append(directory.route(acme, "support", raw, config().routing.model_copy(update={"affinity": "session"})))
    assert routed[0].target.model == routed[1].target.model and routed[0].key == routed[1].key != "acme"
    plain = directory.route(acme, "support", "user-1", config().routing.model_copy(update={"affinity": "session"}))
    assert plain.key.startswith("acme/")
