"""The web console in a real headless browser.

Real parts only: `chronoq serve --http-port` in its own process, timers sent with the SDK, and
Debian's chromium driven by selenium through Debian's matching chromium-driver (installed by
`scripts/setup.sh --browser`; nothing is downloaded). The test loads the page, finds the topic
and the pending timer it sent, cancels it (accepting the confirmation), and sees it gone; then it
looks the message up (cancelled), and types a malformed range (a clear message, no trace).
A second test runs the server with auth on and opens the page as a user without the admin role,
its credentials in the address (http://user:secret@host/): the drop-down holds that user's
topics, no error shows and no request fails, its search finds its own pending timers and
nothing of another user's topic, and the range error reads in the form's words.

It saves a screenshot of each view in its temp directory, and in CHRONOQ_SCREENSHOT_DIR when set
(how docs/console/*.png were made: `CHRONOQ_SCREENSHOT_DIR=docs/console pytest -m browser`).

Without chromium or chromedriver the test is skipped with the command that installs them,
except under CI (CI=true), where a missing browser fails: CI's setup installs it.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from chronoq import envvars
from chronoq.client import Consumer, Producer
from chronoq.client.testing import ServerProcess, free_port
from tests.support.extras import need_command, need_module

pytestmark = [pytest.mark.slow, pytest.mark.browser]

TOPIC = "browser-orders"
OTHER = "browser-invoices"
USER, USER_SECRET = "orders-team", "orders-s3cret"
USER_TOPICS = ("browser-orders", "browser-payments-eu")
OTHERS_TOPIC = "browser-hr-secret"
AUTH_TOML = f"""
[auth]
enabled = true

[[auth.users]]
access_key = "ops"
secret_key = "0ps-s3cret"
admin = true

[[auth.users]]
access_key = "{USER}"
secret_key = "{USER_SECRET}"
publish = ["browser-orders", "browser-payments-*"]
subscribe = ["browser-orders"]
groups = ["billing"]

[[auth.users]]
access_key = "hr-team"
secret_key = "hr-s3cret"
publish = ["{OTHERS_TOPIC}"]
subscribe = ["{OTHERS_TOPIC}"]
"""
WAIT_S = 30.0
"""Generous: a shared 2-core machine may be slow to start chromium or render."""


def _browser_paths() -> tuple[str, str]:
    return need_command("chromium", "chromium-browser", extra="browser"), need_command("chromedriver", extra="browser")


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    chromium, driver_path = _browser_paths()
    webdriver = need_module("selenium.webdriver", "test")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # failed requests, script errors
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1200,1500", f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(arg)
    # An explicit driver path: selenium's own driver manager (which downloads) never runs.
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(check: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except Exception as exc:  # the DOM is being rebuilt by the page's script: look again
            last = exc
        else:
            if last:
                return last
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {last!r})")


def screenshot(driver: Any, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"console-{name}.png"
    driver.save_screenshot(str(path))
    if target := os.environ.get(envvars.SCREENSHOT_DIR):
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(target) / path.name)
    return path


def row_ids(driver: Any, table: str) -> list[str]:
    from selenium.webdriver.common.by import By

    return [r.get_attribute("data-message-id") for r in driver.find_elements(By.CSS_SELECTOR, f"#{table} tbody tr")]


def test_console_find_cancel_and_bad_input(tmp_path: Path, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    http_port = free_port()
    settings = {"http_port": http_port, "console_sample_interval_ms": 500}
    with ServerProcess(tmp_path / "data", settings=settings) as server:
        with Producer(server.address) as producer:
            producer.create_topic(TOPIC)
            producer.create_topic(OTHER)
            # Timers spread over the next hour for the chart; a few due at once for the error chart.
            for minute in (3, 7, 7, 12, 20, 20, 20, 33, 41, 55):
                producer.send(TOPIC, f"reminder {minute}", delay=timedelta(minutes=minute), keys=[f"r{minute}"])
            for i in range(6):
                producer.send(OTHER, f"invoice {i}", delay=timedelta(milliseconds=300 + 150 * i))
            target = producer.send(TOPIC, "cancel me", delay=timedelta(minutes=30), keys=["order-42"])
            for i in range(4):
                producer.send(OTHER, f"now {i}")
        with Consumer("billing", OTHER, server=server.address) as consumer:
            consumer.receive(3, wait=timedelta(seconds=2))  # in flight; the rest is lag
        time.sleep(2.0)  # a few sampling intervals, so the error chart has points

        base = f"http://127.0.0.1:{http_port}"
        browser.get(base + "/")
        wait_for(lambda: browser.find_element(By.CSS_SELECTOR, f'#topics tr[data-topic="{TOPIC}"]'),
                 f"topic {TOPIC} in the topics table")
        row = browser.find_element(By.CSS_SELECTOR, f'#topics tr[data-topic="{TOPIC}"]')
        assert row.find_elements(By.TAG_NAME, "td")[2].text == "11"  # pending timers
        wait_for(lambda: "billing" in browser.find_element(By.ID, "groups").text, "the consumer group")
        wait_for(lambda: browser.execute_script(
            "const i = document.getElementById('pending-chart'); return i.complete && i.naturalWidth > 0"),
            "the pending chart")
        screenshot(browser, tmp_path, "overview")

        # Search the topic's pending timers (the topic's own button fills in the search).
        row.find_element(By.TAG_NAME, "button").click()
        wait_for(lambda: target.message_id in row_ids(browser, "results"), "the sent timer in the search results")
        assert len(row_ids(browser, "results")) == 11
        browser.execute_script("document.getElementById('timers').scrollIntoView()")
        screenshot(browser, tmp_path, "search")

        # Cancel it: the page asks first; accept, and the row goes.
        cancel = browser.find_element(By.CSS_SELECTOR, f'#results tr[data-message-id="{target.message_id}"] button')
        cancel.click()
        alert = wait_for(lambda: browser.switch_to.alert, "the confirmation")
        assert target.message_id in alert.text and "Cancel timer" in alert.text
        alert.accept()
        wait_for(lambda: target.message_id not in row_ids(browser, "results"), "the cancelled timer to disappear")
        assert len(row_ids(browser, "results")) == 10
        assert "cancelled " + target.message_id in browser.find_element(By.ID, "status").text

        # Look it up by key: cancelled, with its due time.
        Select(browser.find_element(By.ID, "lookup-kind")).select_by_value("key")
        browser.find_element(By.ID, "lookup-value").send_keys("order-42")
        browser.find_element(By.ID, "lookup-button").click()
        wait_for(lambda: "cancelled" in browser.find_element(By.ID, "lookup-result").text, "the lookup result")
        browser.execute_script("document.getElementById('lookup').scrollIntoView()")
        screenshot(browser, tmp_path, "lookup")

        # Unknown id, then a malformed and a huge range: a clear message each, never a trace.
        lookup_value = browser.find_element(By.ID, "lookup-value")
        Select(browser.find_element(By.ID, "lookup-kind")).select_by_value("id")
        lookup_value.clear()
        lookup_value.send_keys("no-such-message")
        browser.find_element(By.ID, "lookup-button").click()
        wait_for(lambda: "no timer message with message id 'no-such-message'"
                 in browser.find_element(By.ID, "status").text, "the unknown-id message")
        for field, text, says in (("search-from", "tomorrow-ish", "cannot read 'tomorrow-ish' as a time"),
                                  ("search-to", "+400d", "more than timer_search_max_range_ms")):
            browser.find_element(By.ID, "search-from").clear()
            browser.find_element(By.ID, "search-from").send_keys("now")
            browser.find_element(By.ID, "search-to").clear()
            browser.find_element(By.ID, "search-to").send_keys("+1d")
            box = browser.find_element(By.ID, field)
            box.clear()
            box.send_keys(text)
            browser.find_element(By.ID, "search-button").click()
            wait_for(lambda says=says: says in browser.find_element(By.ID, "status").text, f"the message {says!r}")
            assert "Traceback" not in browser.page_source
        browser.execute_script("window.scrollTo(0, 0)")
        screenshot(browser, tmp_path, "bad-input")


def failed_requests(driver: Any) -> list[str]:
    """The browser console's errors since last asked: a request answered 4xx/5xx, a script error."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_console_as_a_user_without_the_admin_role(tmp_path: Path, browser: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    config = tmp_path / "chronoq.toml"
    config.write_text(AUTH_TOML)
    # The readiness check's and the topic set-up's admin calls sign as the admin user.
    monkeypatch.setenv(envvars.ACCESS_KEY, "ops")
    monkeypatch.setenv(envvars.SECRET_KEY, "0ps-s3cret")
    http_port = free_port()
    with ServerProcess(tmp_path / "data", settings={"http_port": http_port}, args=["--config", str(config)]) as server:
        with Producer(server.address) as admin:
            for topic in (*USER_TOPICS, OTHERS_TOPIC):
                admin.create_topic(topic)
        mine = []
        with Producer(server.address, access_key=USER, secret_key=USER_SECRET) as producer:
            for topic, minutes in ((USER_TOPICS[0], 5), (USER_TOPICS[0], 50), (USER_TOPICS[1], 20)):
                mine.append(producer.send(topic, "mine", delay=timedelta(minutes=minutes), keys=["shared-key"]))
        with Producer(server.address, access_key="hr-team", secret_key="hr-s3cret") as producer:
            theirs = [producer.send(OTHERS_TOPIC, "not yours", delay=timedelta(minutes=m), keys=["shared-key"])
                      for m in (10, 30)]

        # Credentials in the address: the page's own requests must work too.
        browser.get(f"http://{USER}:{USER_SECRET}@127.0.0.1:{http_port}/")
        wait_for(lambda: browser.find_element(By.CSS_SELECTOR, f'#topics tr[data-topic="{USER_TOPICS[1]}"]'),
                 "the user's topics in the topics table")
        options = [o.text for o in Select(browser.find_element(By.ID, "search-topic")).options]
        assert options == ["(all my topics)", *USER_TOPICS], options
        topics = [r.get_attribute("data-topic") for r in browser.find_elements(By.CSS_SELECTOR, "#topics tbody tr")]
        assert topics == list(USER_TOPICS), topics
        assert "signed in as " + USER in browser.find_element(By.ID, "who").text

        # The initial search (no topic chosen): the user's pending timers, none of another user's.
        want = {r.message_id for r in mine}
        wait_for(lambda: set(row_ids(browser, "results")) == want, "the user's timers in the search results")
        shown_topics = {r.find_elements(By.TAG_NAME, "td")[1].text
                        for r in browser.find_elements(By.CSS_SELECTOR, "#results tbody tr")}
        assert shown_topics == set(USER_TOPICS)
        assert not browser.find_elements(By.CSS_SELECTOR, "#results button.cancel")  # cancel is the admins'
        wait_for(lambda: browser.execute_script(
            "const i = document.getElementById('pending-chart'); return i.complete && i.naturalWidth > 0"),
            "the pending chart")
        chart = browser.execute_script(
            "return fetch(new URL('/chart/pending.svg?horizon=1h', location.origin)).then(r => r.text())")
        assert "3 due in your topics in the next hour" in chart, chart

        # No red banner, no broken request, the admin views hidden rather than failing.
        status = browser.find_element(By.ID, "status")
        assert not status.is_displayed() or "error" not in status.get_attribute("class"), status.text
        assert not browser.find_element(By.ID, "error-chart").is_displayed()
        assert failed_requests(browser) == []
        page = browser.page_source
        assert OTHERS_TOPIC not in page and "admin only" not in page
        assert all(t.message_id not in page for t in theirs)
        screenshot(browser, tmp_path, "user-overview")

        # One topic chosen: its timers only.
        Select(browser.find_element(By.ID, "search-topic")).select_by_value(USER_TOPICS[1])
        browser.find_element(By.ID, "search-button").click()
        wait_for(lambda: row_ids(browser, "results") == [mine[2].message_id], "the chosen topic's timer")

        # Look-up by a key both users' messages carry: the user's only.
        Select(browser.find_element(By.ID, "lookup-kind")).select_by_value("key")
        browser.find_element(By.ID, "lookup-value").send_keys("shared-key")
        browser.find_element(By.ID, "lookup-button").click()
        wait_for(lambda: set(row_ids(browser, "lookup-result")) == want, "the user's messages in the look-up")
        assert OTHERS_TOPIC not in browser.find_element(By.ID, "lookup-result").text

        # A reversed range: the form's words and UTC times, not a field name and epoch ms.
        for field, text in (("search-from", "+1h"), ("search-to", "now")):
            box = browser.find_element(By.ID, field)
            box.clear()
            box.send_keys(text)
        browser.find_element(By.ID, "search-button").click()
        said = wait_for(lambda: (t := browser.find_element(By.ID, "status").text) and "range" in t and t,
                        "the range error")
        assert "the range's end, to 'now' (" in said and "UTC), is before its start, due from '+1h' (" in said, said
        assert "to_ms" not in said
        errors = failed_requests(browser)  # the refused search's 400, nothing else
        assert len(errors) == 1 and "/api/search" in errors[0] and "status of 400" in errors[0], errors
        browser.execute_script("window.scrollTo(0, 0)")
        screenshot(browser, tmp_path, "user-bad-range")
