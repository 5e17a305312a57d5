"""Headless Chromium driven by Selenium, for the console tests.

Chromium and its driver are the Debian `chromium` and `chromium-driver` packages
(scripts/chromium.sh, run by `make test`). Without them the tests skip, and fail under
HIVENET_REQUIRE_REAL_ENGINES=1 (as CI runs them). Nothing is downloaded: the driver's path
is given, so Selenium Manager is never asked for one.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Screenshots go to build/console/ (ignored by git), so a test run leaves the checkout
# clean; HIVENET_CONSOLE_SHOTS=docs/console refreshes the pictures docs/console.md shows.
SHOTS = ROOT / (os.environ.get("HIVENET_CONSOLE_SHOTS") or "build/console")
WINDOW = (1366, 860)  # a laptop's screen
# What Chromium logs, by itself, for an answer the console asked for and shows as refused:
# "http://.../admin/health - Failed to load resource: the server responded with a status
# of 401 (Unauthorized)". Nothing else may be logged at the SEVERE level.
REFUSED = re.compile(r"Failed to load resource: the server responded with a status of (\d{3})")


def binaries() -> tuple[str, str]:
    """chromium and chromedriver, or a skip (a failure under CI) when they are missing."""
    found = shutil.which("chromium"), shutil.which("chromedriver")
    if found[0] is None or found[1] is None:
        message = "chromium/chromedriver not installed (scripts/chromium.sh)"
        if os.environ.get("HIVENET_REQUIRE_REAL_ENGINES") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return found[0], found[1]


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium, closed at the end."""
    browser, driver_path = binaries()
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        if os.environ.get("HIVENET_REQUIRE_REAL_ENGINES") == "1":
            raise
        pytest.skip("selenium is not installed (pip install -e '.[dev]')")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    profile = tempfile.mkdtemp(prefix="hivenet-chromium-")
    for argument in (
        "--headless=new",
        "--no-sandbox",  # tests may run as root, in a container
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait_for(driver: Any, predicate: Callable[[], object], timeout: float = 20.0) -> Any:
    """Poll `predicate` (which may raise while the page is changing) until it is truthy."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception as error:
            last, value = error, None
        if value:
            return value
        time.sleep(0.1)
    shot = ROOT / "build" / "console-failure.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(shot))
    raise AssertionError(f"timed out; last error {last!r}; page saved to {shot}")


def problems(driver: Any, refused: set[int] = frozenset()) -> list[str]:
    """The browser's SEVERE log lines since the last call, less the refusals in `refused`
    (statuses the test caused on purpose and the console showed)."""
    out = []
    for entry in driver.get_log("browser"):
        if entry["level"] != "SEVERE":
            continue
        found = REFUSED.search(entry["message"])
        if found is not None and int(found.group(1)) in refused:
            continue
        out.append(entry["message"])
    return out


def screenshot(driver: Any, name: str) -> None:
    """A PNG of the page as the operator sees it, for docs/console.md."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(SHOTS / f"{name}.png"))
