"""`loom web` in a real headless Chromium: its fake camera, fed a generated clip, goes to a real engine
process (the embedded model) over WebRTC and comes back restyled to the page, which is driven like a
user would: its prompt box, its sliders, a bad value, a second page, a wrong token.

One `loom web` and one browser serve the whole module (starting them is most of its time; one each per
pytest-xdist worker that runs any of its tests); each test waits on conditions the page reports
(`window.loom`, page.js), never on wall-clock bounds. The screenshot goes to pytest's temporary folder, or
to LOOM_WEB_SCREENSHOT when set (how docs/web-page.png is made).
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("aiortc", reason="the web host needs aiortc: pip install -e '.[web]'")
pytest.importorskip("aiohttp", reason="the web host needs aiohttp: pip install -e '.[web]'")
pytest.importorskip("selenium.webdriver", reason="the browser tests drive Chromium with selenium")

from loom_live.plugin.media.generated_clip import generate_clip  # noqa: E402
from tests.fakes.media import write_y4m  # noqa: E402
from tests.integration.web_page import NEEDS_CHROMIUM, chromium, js, open_page, page_url, stop, wait  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SIZE = 128  # small frames: the embedded model on a loaded 2-core box still makes a few per second
FPS = 10
PAIRS = 4  # timed frame pairs looked at per phase

pytestmark = NEEDS_CHROMIUM


@pytest.fixture(scope="module")
def show(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("web")
    camera = write_y4m(tmp / "camera.y4m", list(generate_clip(40, size=(SIZE, SIZE), fps=FPS, seed=1)), fps=FPS)
    token_file = tmp / "token"
    token_file.write_text("a-token-for-the-browser-test-0123\n")
    token_file.chmod(0o600)
    log = open(tmp / "loom.log", "w+")  # noqa: SIM115 (read while the process writes)
    proc = subprocess.Popen(
        [sys.executable, "-m", "loom_live.plugin.cli", "web", "127.0.0.1:0", "--web-token-file", str(token_file),
         "--size", f"{SIZE}x{SIZE}", "--fps", str(FPS), "-p", "thermal camera",
         "--set", f"resolution.width={SIZE}", "--set", f"resolution.height={SIZE}", "--set", "stream.steps=[700]"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log,
        env={**os.environ, "OMP_NUM_THREADS": "1"})  # one torch thread: two fight the browser on a 2-core box
    driver = None
    try:
        url = wait("the page's address", lambda: page_url(tmp / "loom.log"), 60.0, proc)
        driver = chromium(tmp / "chromium", camera)
        open_page(driver, url, proc)
        # a worker of pytest-xdist may be handed any test of this file first: each starts from a page that
        # drives and shows frames
        wait("the page to drive", lambda: js(driver, "window.loom.state && window.loom.state.role") == "driver",
             proc=proc)
        wait("the first frame on the page", lambda: js(driver, "window.loom.shown") >= 1, proc=proc)
        yield {"driver": driver, "url": url, "proc": proc, "log": tmp / "loom.log", "tmp": tmp}
    finally:
        if driver is not None:
            driver.quit()
        stop(proc)
        log.close()


def _pairs_after(show: dict, t: float, skip: int = 2) -> list[dict]:
    """PAIRS timed (camera frame, restyled frame) pairs whose camera frame was drawn after page time `t`,
    past the first `skip` (a chunk the engine had begun before the change)."""
    def ready() -> list[dict] | None:
        pairs = [p for p in js(show["driver"], "window.loom.pairs") if p["at"] > t]
        return pairs[skip:skip + PAIRS] if len(pairs) >= skip + PAIRS else None

    return wait(f"{PAIRS} restyled frames after page time {t:.0f} ms", ready, proc=show["proc"])


def _grey(thumb: list[int]) -> np.ndarray:
    return np.asarray(thumb, np.float32).reshape(-1, 3).mean(axis=1)


def _difference(pairs: list[dict]) -> float:
    return float(np.mean([np.abs(np.asarray(p["output"], np.float32) - np.asarray(p["input"], np.float32)).mean()
                          for p in pairs]))


def _brightness(pairs: list[dict]) -> float:
    return float(np.mean([np.mean(p["output"]) for p in pairs]))


def _now(driver: Any) -> float:
    return float(js(driver, "performance.now()"))


def _set_slider(driver: Any, control: str, value: float) -> None:
    """Move a range input as a drag would end: its value, then its change event."""
    driver.execute_script(
        "const r = document.getElementById(arguments[0] + '-range'); r.value = arguments[1];"
        "r.dispatchEvent(new Event('input')); r.dispatchEvent(new Event('change'));", control, value)


def _type(driver: Any, element_id: str, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element("id", element_id)
    box.send_keys(Keys.CONTROL, "a")  # what is typed replaces what the page shows
    box.send_keys(text, Keys.ENTER)


def test_restyled_frames_arrive_and_follow_the_camera(show):
    driver = show["driver"]
    wait("the page to drive", lambda: js(driver, "window.loom.state && window.loom.state.role") == "driver")
    pairs = _pairs_after(show, 0.0, skip=0)
    # Restyled: the embedded model's thermal style is far from the camera's colours.
    assert _difference(pairs) > 12, pairs[0]
    # Following: each restyled frame is more like the camera frame it came from than like camera frames
    # drawn at other times of the moving clip.
    matched = [np.corrcoef(_grey(p["output"]), _grey(p["input"]))[0, 1] for p in pairs]

    def others() -> list[float]:  # empty until the camera has drawn frames a second away from the pairs'
        sent = js(driver, "Array.from(window.loom.stamped.values()).filter((v, i) => i % 3 === 0)")
        return [np.corrcoef(_grey(p["output"]), _grey(q["thumb"]))[0, 1]
                for p in pairs for q in sent if abs(q["t"] - p["at"]) > 1000]

    other = wait("camera frames drawn a second away from the compared ones", others, proc=show["proc"])
    assert np.mean(matched) > np.mean(other) + 0.1, (np.mean(matched), np.mean(other))
    # Timed glass to glass (camera frame drawn -> restyled frame shown) and shown beside the engine's own.
    assert all(p["ms"] > 0 for p in pairs)
    wait("the glass-to-glass figure on the page", lambda: driver.find_element("id", "g2g").text.endswith(" ms"))
    assert "loom web: the page is at" in show["log"].read_text()  # its lines say the command the user typed


def test_a_prompt_and_a_slider_from_the_page_change_the_stream(show):
    driver = show["driver"]
    _type(driver, "transition_chunks", "0")  # a prompt change lands at once
    wait("transition chunks 0", lambda: js(driver, "window.loom.state.controls.transition_chunks") == 0)
    thermal = _pairs_after(show, _now(driver))

    _type(driver, "prompt", "pencil sketch")
    t = _now(driver)
    wait("the page to show the resolved style", lambda: "pencil_sketch" in driver.find_element("id", "style").text)
    sketched = _pairs_after(show, t)
    # The embedded model's pencil sketch is a pale picture; its thermal style is not.
    assert _brightness(sketched) > _brightness(thermal) + 30, (_brightness(sketched), _brightness(thermal))
    assert "pencil sketch" in driver.find_element("id", "prompts").text

    _set_slider(driver, "noise_scale", 0.1)
    t = _now(driver)
    wait("noise scale 0.1", lambda: abs(js(driver, "window.loom.state.controls.noise_scale") - 0.1) < 1e-6)
    # The slider reaches the engine live: the session's noise (at most the static-scene value the slider
    # sets; motion lowers it) drops from the preset's 0.8 to 0.1 or less.
    wait("the engine's noise scale", lambda: (js(driver, "window.loom.state.session.noise_scale") or 1.0) <= 0.1001)
    assert _pairs_after(show, t), "the stream goes on after the slider"


def test_a_bad_value_is_refused_on_the_page_and_the_stream_goes_on(show):
    driver = show["driver"]
    shown = js(driver, "window.loom.shown")
    _type(driver, "noise_scale", "5")
    message = wait("the refusal on the page", lambda: driver.find_element("id", "message").text
                    if "refused" in driver.find_element("id", "message").get_attribute("class") else None)
    assert "noise_scale" in message and "[0.1, 1]" in message
    wait("more restyled frames", lambda: js(driver, "window.loom.shown") > shown + 1, proc=show["proc"])


def test_the_default_models_page_offers_no_reference_and_says_an_applied_refusal_as_refused(show):
    """The embedded default reads its input's edges only: the page shows the control scale but no reference
    picker. A reference sent anyway passes the page's checks and is refused when the frame loop applies it:
    the page says that refusal as refused, not in the colour of an accepted change."""
    import base64

    import cv2

    driver = show["driver"]
    wait("the control panel", lambda: not driver.find_element("id", "vace").get_attribute("hidden"))
    assert driver.find_element("id", "reference").find_element("xpath", "..").get_attribute("hidden")
    png = base64.b64encode(cv2.imencode(".png", np.zeros((8, 8, 3), np.uint8))[1].tobytes()).decode()
    driver.execute_script("control('reference', {name: 'look.png', data: arguments[0]});", png)
    message = wait("the applied refusal on the page", lambda: driver.find_element("id", "message").text
                   if "edges only" in driver.find_element("id", "message").text
                   and "refused" in driver.find_element("id", "message").get_attribute("class") else None)
    assert message.startswith("reference: the model reads its input's edges only")


def test_a_wrong_token_is_refused_and_a_second_page_only_watches(show):
    driver = show["driver"]
    first = driver.current_window_handle
    url = show["url"]
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url.replace("?token=", "?token=wrong"), timeout=10)
    assert refused.value.code == 403
    driver.switch_to.new_window("tab")
    try:
        driver.get(url.replace("?token=", "?token=wrong"))
        assert "refused" in driver.find_element("tag name", "body").text
        open_page(driver, url)  # the right token: a second page, which watches
        wait("the second page's role", lambda: js(driver, "window.loom.state && window.loom.state.role"))
        assert js(driver, "window.loom.state.role") == "viewer"
        driver.execute_script("send({type: 'control', control: 'steps', value: 2})")
        wait("the read-only refusal", lambda: any("read-only" in r for r in js(driver, "window.loom.refusals")))
    finally:
        driver.close()
        driver.switch_to.window(first)
    shown = js(driver, "window.loom.shown")
    wait("the show going on", lambda: js(driver, "window.loom.shown") > shown + 1, proc=show["proc"])
    assert "refused" in show["log"].read_text()


def test_screenshot(show):
    driver = show["driver"]
    wait("a timed frame", lambda: js(driver, "window.loom.g2g.length") > 0)
    target = Path(os.environ.get("LOOM_WEB_SCREENSHOT") or show["tmp"] / "web-page.png")
    assert driver.save_screenshot(str(target))
    assert target.stat().st_size > 10_000
