"""The admin console in a real browser: headless Chromium (Debian's chromium and chromium-driver,
which `make test` installs) driven by selenium, against a real server (uvicorn) over a real
redis-server, with two tenants. One browser for the module; the tests run in order, as one
admin's session: log in; issue a key, use it (200), revoke it (401); change a plan's
requests_per_minute and see it enforced; read the usage chart's tokens; watch the live panel
refresh; every page readable by keyboard and in a narrow window; log out. Last, the browser's own
logs: no console error, and no request to any host but the server.

`BATCHGATE_CONSOLE_SCREENSHOTS=docs/console` writes a screenshot of each page there (docs/CONSOLE.md).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.console.sessions import COOKIE
from tests.gateway.conftest import LiveServer
from tests.gateway.console.conftest import ADMIN_KEY, KEYS, console_app

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SCREENSHOTS = os.environ.get("BATCHGATE_CONSOLE_SCREENSHOTS")
PAGES = {
    "tenants": "/ui/tenants",
    "tenant": "/ui/tenants/globex",
    "plans": "/ui/plans",
    "keys": "/ui/keys",
    "usage": "/ui/usage",
    "live": "/ui/live",
    "batches": "/ui/batches",
    "adapters": "/ui/adapters",
    "prices": "/ui/prices",
    "audit": "/ui/audit",
}
# Tokens of the chat requests this module made that were answered (a refusal costs nothing).
SPENT: dict[str, int] = {}


@pytest.fixture(scope="module")
def server(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    client = redis.Redis.from_url(redis_server)
    try:
        client.flushall()
    finally:
        client.close()
    app = console_app(tmp_path_factory.mktemp("console-browser"), redis_server)
    live = LiveServer(app)
    live.app = app  # type: ignore[attr-defined]
    try:
        yield live
    finally:
        live.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    for binary in (CHROMIUM, CHROMEDRIVER):
        if not os.access(binary, os.X_OK):
            pytest.fail(
                f"{binary} is missing: `make test` installs Debian's chromium and chromium-driver "
                "(or: apt-get install chromium chromium-driver)"
            )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="batchgate-chromium-")
    # Headless, and nothing of Chromium's own traffic (updates, sync, field trials): the only
    # requests are the pages' (this machine's network is closed besides).
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-default-apps",
        "--disable-extensions",
        f"--user-data-dir={profile}",
        "--window-size=1280,900",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.implicitly_wait(0)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def chat(server: LiveServer, tenant: str, key: str | None = None) -> httpx.Response:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6}
    response = httpx.post(
        server.base_url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key or KEYS[tenant]}"},
        timeout=10,
    )
    if response.status_code == 200:
        SPENT[tenant] = SPENT.get(tenant, 0) + response.json()["usage"]["total_tokens"]
    return response


def wait_for(predicate: Callable[[], Any], within_s: float = 10.0) -> Any:
    """The first truthy value of `predicate()` (polled; a bound, not a sleep)."""
    deadline = time.monotonic() + within_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {within_s} s"
        time.sleep(0.05)


def by_css(driver: Any, selector: str) -> Any:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, selector)


def button(driver: Any, text: str, within: Any = None) -> Any:
    from selenium.webdriver.common.by import By

    return (within or driver).find_element(By.XPATH, f".//button[normalize-space()='{text}']")


def flash(driver: Any) -> str:
    return str(wait_for(lambda: " ".join(e.text for e in driver.find_elements("css selector", ".flash"))))


def text_of(driver: Any, element_id: str) -> str:
    """An element's text read in one step (the live panel swaps its elements under a reader)."""
    return str(driver.execute_script(f"return document.getElementById('{element_id}').textContent"))


def open_page(driver: Any, server: LiveServer, path: str) -> None:
    driver.get(server.base_url + path)
    wait_for(lambda: driver.execute_script("return document.readyState") == "complete")


def shoot(driver: Any, name: str) -> None:
    """A screenshot of the whole page (up to 2,400 pixels down) for the docs, when asked for."""
    if not SCREENSHOTS:
        return
    # The capture lays the whole page out without a scrollbar: the window's full width.
    width = driver.execute_script("return window.innerWidth")
    height = min(driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]["height"], 2400)
    clip = {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip}
    )
    Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
    (Path(SCREENSHOTS) / f"{name}.png").write_bytes(base64.b64decode(shot["data"]))


def test_log_in_with_the_admin_key(browser: Any, server: LiveServer) -> None:
    from selenium.webdriver.common.keys import Keys

    open_page(browser, server, "/ui/keys")
    assert browser.current_url.startswith(server.base_url + "/ui/login?next=/ui/keys")
    field = by_css(browser, "#admin-key")
    assert field.get_attribute("type") == "password"
    assert browser.execute_script("return document.activeElement.id") == "admin-key"  # autofocus
    shoot(browser, "login")
    field.send_keys("not-the-key", Keys.ENTER)
    assert "not the admin key" in flash(browser)
    by_css(browser, "#admin-key").send_keys(ADMIN_KEY, Keys.ENTER)
    wait_for(lambda: browser.current_url == server.base_url + "/ui/keys")
    cookie = browser.get_cookie(COOKIE)
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/ui"
    assert ADMIN_KEY not in browser.page_source
    # The key is nowhere the page's scripts can reach: no cookie, no storage.
    stored = browser.execute_script(
        "return [document.cookie, JSON.stringify(localStorage), JSON.stringify(sessionStorage)].join(' ')"
    )
    assert ADMIN_KEY not in stored and COOKIE not in stored


def test_issue_a_key_use_it_then_revoke_it(browser: Any, server: LiveServer) -> None:
    from selenium.webdriver.support.ui import Select

    open_page(browser, server, "/ui/keys")
    Select(by_css(browser, "#issue-tenant")).select_by_visible_text("acme")
    by_css(browser, "#issue-name").send_keys("from the console")
    button(browser, "Issue key").click()
    raw = wait_for(lambda: browser.find_elements("css selector", "#new-key")).pop().get_attribute("value")
    assert raw.startswith("bg-")
    browser.execute_cdp_cmd(
        "Browser.grantPermissions",
        {"origin": server.base_url, "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]},
    )
    button(browser, "Copy").click()
    assert wait_for(lambda: by_css(browser, "#copy-status").text) == "Copied."
    copied = browser.execute_async_script("navigator.clipboard.readText().then(arguments[0])")
    assert copied == raw
    shoot(browser, "keys-issued")
    assert chat(server, "acme", raw).status_code == 200

    open_page(browser, server, "/ui/keys?tenant=acme")
    key_id = next(
        row.find_element("css selector", "th code").text
        for row in browser.find_elements("css selector", "tbody tr")
        if "from the console" in row.text
    )
    row = next(r for r in browser.find_elements("css selector", "tbody tr") if key_id in r.text)
    button(browser, "Revoke", row).click()
    browser.switch_to.alert.accept()
    assert f"Key {key_id} of acme revoked." in flash(browser)
    assert chat(server, "acme", raw).status_code == 401


def test_a_plans_requests_per_minute_changed_here_is_enforced(browser: Any, server: LiveServer) -> None:
    assert chat(server, "globex").status_code == 200
    open_page(browser, server, "/ui/plans/free")
    field = by_css(browser, "#field-requests_per_minute")
    assert field.get_attribute("value") == "600"
    field.clear()
    field.send_keys("2")
    button(browser, "Save plan").click()
    assert "Plan free saved." in flash(browser)
    assert by_css(browser, "#field-requests_per_minute").get_attribute("value") == "2"
    # A bucket of 2 requests a minute: two more pass, the next is refused.
    statuses = [chat(server, "globex").status_code for _ in range(3)]
    assert statuses == [200, 200, 429]


def test_the_usage_chart_shows_the_tokens_of_these_requests(browser: Any, server: LiveServer) -> None:
    for _ in range(2):
        assert chat(server, "acme").status_code == 200
    open_page(browser, server, "/ui/usage?width=1h&range=24h&by=tenant")
    series = wait_for(
        lambda: browser.execute_script(
            "const chart = window.Chart && Chart.getChart('chart-tokens');"
            "return chart && chart.data.datasets.map(d => [d.label, d.data.reduce((a, b) => a + b, 0)]);"
        )
    )
    assert dict(series) == SPENT and set(SPENT) == {"acme", "globex"}
    drawn = browser.execute_script(
        "const chart = Chart.getChart('chart-tokens'); return chart.getDatasetMeta(0).data.length"
    )
    assert drawn == len(browser.execute_script("return Chart.getChart('chart-tokens').data.labels"))
    assert by_css(browser, "#chart-tokens").get_attribute("role") == "img"
    csv = by_css(browser, "a[download]").get_attribute("href")
    assert csv.startswith(server.base_url + "/ui/usage.csv?")
    shoot(browser, "usage")


def test_the_live_panel_refreshes_without_a_reload(browser: Any, server: LiveServer) -> None:
    open_page(browser, server, "/ui/live")
    browser.execute_script("window.notReloaded = true")
    first = text_of(browser, "live-updated")
    assert chat(server, "acme").status_code == 200
    wait_for(lambda: text_of(browser, "live-updated") != first, within_s=8)
    assert browser.execute_script("return window.notReloaded") is True
    panel = text_of(browser, "live-panel")
    assert "fake-model" in panel and "ready" in panel
    # Two readings a refresh apart: the last minute's figures are there.
    wait_for(lambda: text_of(browser, "ttft-p50") not in ("", "—"), within_s=8)
    shoot(browser, "live")


def _unlabelled(driver: Any) -> list[str]:
    """Form controls without a label a screen reader would read."""
    return list(
        driver.execute_script(
            "return [...document.querySelectorAll('input:not([type=hidden]), select, textarea')]"
            ".filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label'))"
            ".map(e => e.outerHTML)"
        )
    )


def test_every_page_by_keyboard_labelled_and_in_a_narrow_window(browser: Any, server: LiveServer) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    acme = {"authorization": f"Bearer {KEYS['acme']}"}
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions"}
    line["body"] = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    upload = httpx.post(
        server.base_url + "/v1/files",
        files={"file": ("in.jsonl", json.dumps(line).encode() + b"\n")},
        data={"purpose": "batch"},
        headers=acme,
    )
    made = httpx.post(  # a batch, for the batches page
        server.base_url + "/v1/batches",
        json={"input_file_id": upload.json()["id"], "endpoint": line["url"], "completion_window": "24h"},
        headers=acme,
    )
    assert made.status_code == 200, made.text
    for name, path in PAGES.items():
        open_page(browser, server, path)
        assert browser.find_elements("css selector", "h1"), path
        assert _unlabelled(browser) == [], path
        shoot(browser, name)
    open_page(browser, server, "/ui/batches")
    browser.find_element("css selector", "tbody th a").click()
    wait_for(lambda: "/ui/batches/batch_" in browser.current_url)
    assert "Batch batch_" in by_css(browser, "h1").text and "acme" in by_css(browser, "dl.facts").text
    shoot(browser, "batch")
    # The first Tab reaches the skip link, Enter moves to the content; the nav is links.
    open_page(browser, server, "/ui/tenants")
    ActionChains(browser).send_keys(Keys.TAB).perform()
    assert browser.execute_script("return document.activeElement.className") == "skip"
    ActionChains(browser).send_keys(Keys.ENTER).perform()
    wait_for(lambda: browser.execute_script("return document.activeElement.id") == "main")
    browser.set_window_size(400, 900)
    try:
        for path in PAGES.values():
            open_page(browser, server, path)
            overflow = browser.execute_script(
                "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
            )
            assert overflow <= 1, (path, overflow)  # wide tables scroll in their own box
        open_page(browser, server, "/ui/tenants")
        shoot(browser, "narrow-tenants")
    finally:
        browser.set_window_size(1280, 900)


def test_log_out_ends_the_session(browser: Any, server: LiveServer) -> None:
    open_page(browser, server, "/ui/audit")
    assert "plan.put" in browser.page_source and "key.revoke" in browser.page_source
    cookie = browser.get_cookie(COOKIE)["value"]
    button(browser, "Log out").click()
    wait_for(lambda: "/ui/login" in browser.current_url)
    assert "You are logged out." in flash(browser)
    assert browser.get_cookie(COOKIE) is None
    replayed = httpx.get(server.base_url + "/ui/tenants", cookies={COOKIE: cookie})
    assert replayed.status_code == 303 and replayed.headers["location"].startswith("/ui/login")


def test_no_console_error_and_no_request_to_another_host(browser: Any, server: LiveServer) -> None:
    """Over every test above (the logs since the browser started)."""
    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
    # The wrong key at the login is answered 401, which Chromium reports; nothing else may be there.
    unexpected = [e for e in errors if not e["message"].startswith(f"{server.base_url}/ui/login - ")]
    assert unexpected == []
    assert len(errors) == 1 and "401" in errors[0]["message"]
    # The browser's own pages (chrome://: its new tab, before the first navigation) aside, every
    # request any page made went to the server, inline data included (there is none).
    fetched = {
        message["params"]["request"]["url"]
        for entry in browser.get_log("performance")
        for message in [json.loads(entry["message"])["message"]]
        if message["method"] == "Network.requestWillBeSent"
        and not message["params"].get("documentURL", "").startswith("chrome://")
    }
    assert fetched and all(url.startswith(server.base_url + "/") for url in fetched), sorted(fetched)
    vendored = ("/ui/static/vendor/htmx.min.js", "/ui/static/vendor/chart.umd.min.js")
    assert {server.base_url + path for path in vendored} <= fetched
