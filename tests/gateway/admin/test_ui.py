"""The status page in a real headless browser (Debian's chromium, driven by Playwright), and `tenantgate status`,
against a gateway in front of a simulated fleet. Screenshots go to test-artifacts/ui/."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, expect, sync_playwright

from loadtests.fleet import ADMIN_TOKEN, RunningFleet, fleet_with_gateway
from tests.servers import debian_tool

# The page refreshes on timers; a busy machine may take longer than Playwright's 5 s default.
expect.set_options(timeout=30_000)

pytestmark = pytest.mark.timeout(180)

ARTIFACTS = Path(__file__).resolve().parents[3] / "test-artifacts" / "ui"
TENANTS = {"acme": ["support-acme"], "globex": ["sql-globex"], "initech": ["chat-initech"]}
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningFleet]:
    sim = ["--time-scale", "0.01", "--max-loras", "4"]
    with fleet_with_gateway(tmp_path_factory.mktemp("ui"), TENANTS, 3, sim, max_adapters=4) as running:
        yield running


@pytest.fixture(scope="module")
def browser_page() -> Iterator[Page]:
    chromium = debian_tool("chromium", "browser")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        yield page
        browser.close()


def test_without_the_token_there_is_only_the_login_form(fleet: RunningFleet, browser_page: Page) -> None:
    page = browser_page
    response = page.goto(fleet.gateway_url + "/admin/ui")
    assert response is not None
    csp = response.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
    expect(page.locator("form input#token")).to_be_visible()
    assert "Replicas" not in page.content()
    assert httpx.get(fleet.gateway_url + "/admin/state").status_code == 401
    page.fill("#token", "wrong")
    page.click("button[type=submit]")
    expect(page.locator(".error")).to_have_text("Wrong token.")


def test_log_in_see_the_fleet_warm_an_adapter_and_drain_a_replica(fleet: RunningFleet, browser_page: Page) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page = browser_page
    page.goto(fleet.gateway_url + "/admin/ui")
    page.fill("#token", ADMIN_TOKEN)
    page.click("button[type=submit]")
    replicas = page.locator("table.replicas tr[data-replica]")
    expect(replicas).to_have_count(3)
    expect(page.locator("table.residency th", has_text="support-acme")).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "1-logged-in.png"), full_page=True)

    home = httpx.get(
        fleet.gateway_url + "/admin/route?tenant=acme", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    ).json()["home"]
    page.locator("table.residency th", has_text="support-acme").get_by_role("button", name="warm").click()
    cell = page.locator(f"table.residency tr[data-replica='{home}'] td[data-adapter='support-acme']")
    expect(cell).to_have_class("resident")
    page.screenshot(path=str(ARTIFACTS / "2-warmed.png"), full_page=True)

    acme_now = page.locator("table.tenants tr[data-tenant='acme'] td.now")
    expect(acme_now).to_have_text(home)
    # predicted_ttft (the default): each candidate's predicted TTFT and its parts, the page's own text from the
    # decision's numbers; the warmed home is fastest, listed first, its adapter on the GPU (most recently used).
    predicted = page.locator("table.tenants tr[data-tenant='acme'] td.predicted")
    expect(predicted).to_contain_text(re.compile(rf"^{home} \d+ ms \((warm|kv_cold): queue \d+ \+ regime \d+"))
    expect(predicted).to_contain_text("affinity 10")  # the other replicas pay the margin for leaving home
    # Where it lives and why: its replica set (one, balanced: homes from traffic are off here).
    placement = page.locator("table.tenants tr[data-tenant='acme'] td.placement")
    expect(placement).to_have_text(f"{home} (balanced)")
    page.locator(f"table.replicas tr[data-replica='{home}']").get_by_role("button", name="drain").click()
    expect(page.locator(f"table.replicas tr[data-replica='{home}'] td", has_text="drained")).to_be_visible()
    expect(acme_now).not_to_have_text(home)  # its tenants move to their next replica
    page.screenshot(path=str(ARTIFACTS / "3-drained.png"), full_page=True)
    page.locator(f"table.replicas tr[data-replica='{home}']").get_by_role("button", name="undrain").click()
    expect(acme_now).to_have_text(home)


def test_actions_need_the_csrf_token(fleet: RunningFleet) -> None:
    with httpx.Client(base_url=fleet.gateway_url, follow_redirects=False) as client:
        client.post("/admin/ui/login", data={"token": ADMIN_TOKEN})
        assert "tenantgate_session" in client.cookies
        refused = client.post("/admin/ui/actions/drain", json={"pool": "llama", "replica": "r0"})
        assert refused.status_code == 401 and "CSRF" in refused.json()["error"]["message"]
        assert client.get("/admin/state").status_code == 200  # the session alone may read


def test_tenantgate_status_prints_the_fleet(fleet: RunningFleet) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "status", "--url", fleet.gateway_url],
        capture_output=True, text=True, env={**os.environ, "TENANTGATE_ADMIN_TOKEN": ADMIN_TOKEN}, timeout=30,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "pool llama" in result.stdout and "acme" in result.stdout
    assert all(replica in result.stdout for replica in ("r0", "r1", "r2"))
    wrong = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "status", "--url", fleet.gateway_url],
        capture_output=True, text=True, env={**os.environ, "TENANTGATE_ADMIN_TOKEN": "nope"}, timeout=30,
    )  # fmt: skip
    assert wrong.returncode == 1 and "401" in wrong.stderr and "Traceback" not in wrong.stderr
