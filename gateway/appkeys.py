"""Typed keys for what the app holds; handlers import these, never the app factory."""

from __future__ import annotations

from aiohttp import web

from gateway.observe.metrics import GatewayMetrics
from gateway.observe.telemetry import Telemetry
from gateway.placement.exchange import FleetTraffic
from gateway.placement.placer import Placer
from gateway.state import GatewayState

STATE = web.AppKey("state", GatewayState)
ADMIN_TOKEN = web.AppKey("admin_token", str)
METRICS = web.AppKey("metrics", GatewayMetrics)
TELEMETRY = web.AppKey("telemetry", Telemetry)
TRAFFIC = web.AppKey("traffic", FleetTraffic)
PLACER = web.AppKey("placer", Placer)
