from __future__ import annotations

import pytest

from gateway.config import load_config
from gateway.errors import AuthenticationFailed, ModelNotFound
from gateway.tenants.directory import TenantDirectory
from gateway.tenants.identity import authenticate, hash_key
from tests.gateway.test_config import EXAMPLE


@pytest.fixture
def directory() -> TenantDirectory:
    return TenantDirectory(load_config(EXAMPLE))


def test_hash_key_is_the_stored_form() -> None:
    assert hash_key("acme-secret-key") == "sha256:b81ff514581f28cf9536d9227563cf3a93e9ced7728e175b4e1d044be8a3ef29"


@pytest.mark.parametrize(
    "header", [None, "", "Bearer ", "Basic acme-secret-key", "Bearer wrong-key", "acme-secret-key"]
)
def test_bad_credentials_are_refused(directory: TenantDirectory, header: str | None) -> None:
    with pytest.raises(AuthenticationFailed):
        authenticate(directory, header)


def test_key_identifies_its_tenant(directory: TenantDirectory) -> None:
    assert authenticate(directory, "Bearer acme-secret-key").id == "acme"
    assert authenticate(directory, "bearer globex-secret-key").id == "globex"


def test_another_tenants_adapter_looks_like_a_missing_one(directory: TenantDirectory) -> None:
    acme = authenticate(directory, "Bearer acme-secret-key")
    with pytest.raises(ModelNotFound) as foreign:
        directory.resolve(acme, "sql-globex")
    with pytest.raises(ModelNotFound) as missing:
        directory.resolve(acme, "no-such-adapter")
    assert foreign.value.body()["error"]["code"] == missing.value.body()["error"]["code"] == "model_not_found"
    assert "sql-globex" not in str(missing.value) and "acme" not in str(foreign.value)


def test_absent_model_is_the_first_adapter(directory: TenantDirectory) -> None:
    acme = authenticate(directory, "Bearer acme-secret-key")
    target = directory.resolve(acme, None)
    assert target.model == "support-acme" and target.adapter is not None
