"""Typed keys for what the app holds; handlers import these, never the app factory."""

from __future__ import annotations

from aiohttp import web

from gateway.config import GatewayConfig
from gateway.fleet import Fleet
from gateway.metrics import GatewayMetrics
from gateway.telemetry import Telemetry
from gateway.tenancy import TenantDirectory

CONFIG = web.AppKey("config", GatewayConfig)
FLEET = web.AppKey("fleet", Fleet)
TENANTS = web.AppKey("tenants", TenantDirectory)
ADMIN_TOKEN = web.AppKey("admin_token", str)
METRICS = web.AppKey("metrics", GatewayMetrics)
TELEMETRY = web.AppKey("telemetry", Telemetry)
