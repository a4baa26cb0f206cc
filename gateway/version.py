"""The installed package's version, as `tenantgate --version` and the tenantgate_build_info metric give it."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def gateway_version() -> str:
    try:
        return version("tenantgate")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"
