"""Headless Chromium for the browser host's tests: started once per module, driving Loom's page."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
NO_CHROMIUM = ("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver; "
               ".ci/run installs them)")
NEEDS_CHROMIUM = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason=NO_CHROMIUM)
WAIT_S = 120.0  # generous: a loaded CI box starts an engine slowly; conditions end the waits early


def wait(what: str, check: Any, timeout_s: float = WAIT_S, proc: subprocess.Popen | None = None) -> Any:
    """`check()`'s first truthy value, polled; fails the test after `timeout_s` or when `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"loom exited with {proc.returncode} while waiting for {what}")
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")


def page_url(log: Path) -> str | None:
    """The address `loom play --web` / `loom web` printed, once it has."""
    found = re.search(r"the page is at (\S+)", log.read_text())
    return found.group(1) if found else None


def chromium(profile: Path, camera: Path | None = None) -> Any:
    """A headless Chromium under selenium; `camera`: a y4m file its fake camera plays."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-background-timer-throttling", "--disable-renderer-backgrounding",
            "--disable-backgrounding-occluded-windows", "--autoplay-policy=no-user-gesture-required",
            "--window-size=1100,760", f"--user-data-dir={profile}"]
    if camera is not None:
        args += ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                 f"--use-file-for-fake-video-capture={camera}"]
    for arg in args:
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def js(driver: Any, expression: str, *args: Any) -> Any:
    return driver.execute_script(f"return {expression};", *args)


def open_page(driver: Any, url: str, proc: subprocess.Popen | None = None, timeout_s: float = WAIT_S) -> None:
    """Load Loom's page at `url` until its script has run (`window.loom` set), loading it again when a load ends
    without it: on a loaded machine a load can end on a page whose script never came, and every check of
    `window.loom` would then fail at once. Fails naming what the browser showed instead."""
    deadline = time.monotonic() + timeout_s
    while True:
        driver.get(url)
        if js(driver, "typeof window.loom") == "object":
            return
        shown = js(driver, "document.title + ': ' + (document.body ? document.body.innerText : '')")[:300]
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"loom exited with {proc.returncode} while its page loaded; the browser showed {shown!r}")
        if time.monotonic() > deadline:
            pytest.fail(f"Loom's page at {url} never ran its script in {timeout_s:g} s; the browser showed {shown!r}")
        time.sleep(1.0)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
