"""Headless Chromium (Debian's ``chromium``, installed by scripts/bootstrap.sh) driven by
Playwright, against a live API. Screenshots go to ``test-artifacts/browser/``."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.browser.live import LiveDeployment, live_deployment
from tests.conftest import ARTIFACTS

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SCREENSHOTS = ARTIFACTS / "browser"


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is not installed: run scripts/bootstrap.sh "
                    "(apt-get install chromium)")
    with sync_playwright() as playwright:
        playwright.selectors.set_test_id_attribute("data-test")  # the dashboard's hooks
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def live(tmp_path: Path) -> Iterator[LiveDeployment]:
    tmp_path.chmod(0o755)
    with live_deployment(tmp_path) as deployment:
        yield deployment


@pytest.fixture
def page(browser: Browser, live: LiveDeployment,
         request: pytest.FixtureRequest) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 900},
                                  base_url=live.url)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    # the dashboard runs under a strict Content-Security-Policy: nothing may break it
    page.on("console", lambda msg: errors.append(msg.text)
            if "Content Security Policy" in msg.text else None)
    yield page
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}-final.png"), full_page=True)
    context.close()
    assert not errors, f"JavaScript errors or CSP violations on the page: {errors}"


def shot(page: Page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)
