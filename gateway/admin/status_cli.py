"""`tenantgate status --url URL`: the status page's state as terminal tables (GET /admin/state)."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from http.client import HTTPMessage
from typing import IO, Any


class StatusError(Exception):
    """One line for the operator: what went wrong reaching the gateway."""


class _SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only within the origin (scheme, host, port) the token was meant for: urllib's own handler
    copies every header, the admin token included, to wherever a redirect points."""

    def redirect_request(
        self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str, headers: HTTPMessage, newurl: str
    ) -> urllib.request.Request | None:
        if _origin(newurl) != _origin(req.full_url):
            raise StatusError(
                f"{req.full_url} redirects to another origin ({_origin(newurl)}): not sending the admin token there"
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _origin(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    return f"{parts.scheme}://{parts.hostname}:{port}"


_OPENER = urllib.request.build_opener(_SameOriginRedirects)


def fetch(url: str, token: str) -> dict[str, Any]:
    request = urllib.request.Request(url.rstrip("/") + "/admin/state", headers={"Authorization": f"Bearer {token}"})
    try:
        with _OPENER.open(request, timeout=10) as response:
            state: dict[str, Any] = json.load(response)
            return state
    except urllib.error.HTTPError as exc:
        detail = json.loads(exc.read() or b"{}").get("error", {}).get("message", exc.reason)
        raise StatusError(f"{url} answered {exc.code}: {detail}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise StatusError(f"cannot reach {url}: {getattr(exc, 'reason', exc)}") from exc


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=False)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def render(state: dict[str, Any]) -> str:
    out = [f"residency store: {state['store']}"]
    if "workers" in state:  # serve --workers: the figures are every worker's (gateway/admin/merge.py)
        answered = ", ".join(str(w["worker"]) for w in state["workers"])
        missing = ", ".join(str(w) for w in state["missing_workers"])
        out[0] += f"; workers: {answered}" + (f" (not answering: {missing})" if missing else "")
    for name, pool in state["pools"].items():
        out.append(f"\npool {name} ({pool['policy']}, working set {pool['max_adapters']})")
        rows = []
        for r in pool["replicas"]:
            status = (
                "down"
                if not r["up"]
                else "drained"
                if r["drained"]
                else "ejected"
                if r["ejected"]
                else ("up" if r["healthy"] else "returning")
            )
            load = r["engine_load"]
            engine = "-" if load is None else f"{load['waiting']:.0f} / {100 * load['kv_cache_usage']:.0f}%"
            resident = ", ".join(f"{a}{'*' if info['pinned'] else ''}" for a, info in r["adapters"].items())
            rows.append([r["id"], status, str(r["in_flight"]), engine, resident or "-"])
        out.append(_table(["replica", "state", "in flight", "waiting / KV", "resident (* pinned)"], rows))
        tenants = [[t["id"], t["home"], t["now"] or "-"] for t in pool["tenants"]]
        out.append(_table(["tenant", "home", "goes to now"], tenants))
    adapters = [
        [name, str(m[-1]["requests"]), f"{m[-1]['ttft_p50_ms']} ms" if m[-1]["ttft_p50_ms"] is not None else "-",
         str(sum(x["cold_loads"] for x in m))]
        for name, m in state["adapters"].items() if m
    ]  # fmt: skip
    if adapters:
        out.append("\n" + _table(["adapter", "requests (last min)", "TTFT p50", "cold loads (10 min)"], adapters))
    return "\n".join(out)
