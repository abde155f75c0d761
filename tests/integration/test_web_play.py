"""`loom play --web` in a real headless Chromium: the page beside a looping file run (the pass-through
engine, a LoRA loaded, a STUN server given), driven as a user would: frames arrive with the input
beside them, pause and resume, the prompt list, the LoRA slider, a bad LoRA value refused on the
page while the stream goes on; and the STUN server reached both peers' configurations.

One `loom play` and one browser serve the module (one each per pytest-xdist worker that runs any of its tests);
the tests wait on what the page reports (`window.loom`, page.js), never on wall-clock bounds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("aiortc", reason="the web host needs aiortc: pip install -e '.[web]'")
pytest.importorskip("aiohttp", reason="the web host needs aiohttp: pip install -e '.[web]'")
pytest.importorskip("selenium.webdriver", reason="the browser tests drive Chromium with selenium")

from loom_live.plugin.media.generated_clip import generate_clip  # noqa: E402
from tests.fakes.media import write_y4m  # noqa: E402
from tests.fakes.stun import MAPPED_HOST, StunServer  # noqa: E402
from tests.integration.web_page import NEEDS_CHROMIUM, chromium, js, open_page, page_url, stop, wait  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SIZE = 96
FPS = 12
PROMPTS = ("thermal camera", "pencil sketch")

pytestmark = NEEDS_CHROMIUM


def _lora(folder: Path) -> Path:
    """A LoRA file that fits the default (embedded) model (zeros: it changes nothing it touches)."""
    import torch
    from safetensors.torch import save_file

    from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT

    with torch.device("meta"):
        q = WanDiT(DIT_PRESETS["embedded"]).blocks[0].self_attn.q.weight
    key = "lora_unet_blocks_0_self_attn_q"
    path = folder / "ink.safetensors"
    save_file({f"{key}.lora_down.weight": torch.zeros(4, q.shape[1]),
               f"{key}.lora_up.weight": torch.zeros(q.shape[0], 4), f"{key}.alpha": torch.tensor(4.0)}, str(path))
    return path


@pytest.fixture(scope="module")
def show(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("web_play")
    clip = write_y4m(tmp / "clip.y4m", list(generate_clip(24, size=(SIZE, SIZE), fps=FPS, seed=2)), fps=FPS)
    lora = _lora(tmp)
    with StunServer() as stun, open(tmp / "loom.log", "w+") as log:
        cmd = [sys.executable, "-m", "loom_live.plugin.cli", "play", "-i", str(clip), "--mode", "live", "--loop",
               "-o", str(tmp / "out.mp4"), "--web", "127.0.0.1:0", "--passthrough", "--lora", f"{lora}:0.7",
               "--ice-server", f"stun:127.0.0.1:{stun.port}", *sum((["-p", p] for p in PROMPTS), [])]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        driver = None
        try:
            url = wait("the page's address", lambda: page_url(tmp / "loom.log"), 60.0, proc)
            driver = chromium(tmp / "chromium")
            open_page(driver, url, proc)
            # a worker of pytest-xdist may be handed any test of this file first: each starts from a page that
            # drives and shows frames
            wait("the page to drive", lambda: js(driver, "window.loom.state && window.loom.state.role") == "driver",
                 proc=proc)
            wait("the first frame on the page", lambda: js(driver, "window.loom.shown") >= 1, proc=proc)
            yield {"driver": driver, "proc": proc, "stun": stun, "log": tmp / "loom.log", "clip": clip, "tmp": tmp}
        finally:
            if driver is not None:
                driver.quit()
            stop(proc)


def _more_frames(show: dict, count: int = 3) -> None:
    driver = show["driver"]
    shown = js(driver, "window.loom.shown")
    wait(f"{count} more frames on the page", lambda: js(driver, "window.loom.shown") >= shown + count,
         proc=show["proc"])


def _controls(driver) -> dict:
    return js(driver, "window.loom.state && window.loom.state.controls") or {}


def test_frames_arrive_with_the_input_beside_them(show):
    driver = show["driver"]
    wait("the page to drive", lambda: js(driver, "window.loom.state && window.loom.state.role") == "driver")
    assert js(driver, "window.loom.hello.mode") == "play"
    _more_frames(show, 5)
    wait("the input preview", lambda: js(driver, "document.getElementById('input').videoWidth") > 0)
    # The restyled picture (here passed through) is the clip's, not a blank frame.
    spread = js(driver, "(() => { const v = document.getElementById('output');"
                        "const c = document.createElement('canvas'); c.width = 32; c.height = 32;"
                        "const x = c.getContext('2d'); x.drawImage(v, 0, 0, 32, 32);"
                        "const d = x.getImageData(0, 0, 32, 32).data; let lo = 255, hi = 0;"
                        "for (let i = 0; i < d.length; i += 4) { lo = Math.min(lo, d[i]); hi = Math.max(hi, d[i]); }"
                        "return hi - lo; })()")
    assert spread > 40, spread
    assert js(driver, "window.loom.state.engine.state") == "running"


def test_the_stun_server_reaches_both_peers(show):
    driver = show["driver"]
    url = f"stun:127.0.0.1:{show['stun'].port}"
    assert js(driver, "pc.getConfiguration().iceServers.map((s) => [].concat(s.urls)).flat()") == [url]
    # Each side gathered a server-reflexive candidate from the STUN server's answer: the page's offer
    # and the host's answer (aiortc) both carry the address only that server hands out.
    assert f"{MAPPED_HOST} " in js(driver, "pc.localDescription.sdp")
    assert f"{MAPPED_HOST} " in js(driver, "pc.remoteDescription.sdp")
    assert len(show["stun"].askers) >= 2


def test_pause_and_resume_from_the_page(show):
    driver = show["driver"]
    driver.find_element("id", "pause").click()
    wait("paused", lambda: _controls(driver).get("paused") is True)
    assert driver.find_element("id", "pause").text == "Resume"
    frames_out = js(driver, "window.loom.state.engine.frames_out")
    _more_frames_stop = [frames_out]

    def settled() -> bool:  # no frame goes to the engine while paused: its count stops
        now = js(driver, "window.loom.state.engine.frames_out")
        still = now == _more_frames_stop[0]
        _more_frames_stop[0] = now
        return still

    wait("the engine's frame count to stop", lambda: settled() and settled())
    driver.find_element("id", "pause").click()
    wait("resumed", lambda: _controls(driver).get("paused") is False)
    _more_frames(show)
    assert js(driver, "window.loom.state.engine.frames_out") > _more_frames_stop[0]


def test_the_prompt_list_picks_a_prompt(show):
    driver = show["driver"]
    items = driver.find_elements("css selector", "#prompts li")
    assert [li.text for li in items] == list(PROMPTS)
    items[1].click()
    wait("the second prompt", lambda: _controls(driver).get("prompt_index") == 1)
    wait("the list to show it", lambda: "current" in driver.find_elements("css selector", "#prompts li")[1]
         .get_attribute("class"))
    wait("the engine's prompt", lambda: js(driver, "window.loom.state.session.prompt") == PROMPTS[1])


def test_the_lora_slider_acts_and_a_bad_value_is_refused_on_the_page(show):
    driver = show["driver"]
    wait("the LoRA slider", lambda: driver.find_elements("id", "lora-0-range"))
    assert "ink" in driver.find_element("css selector", "#loras label").text
    assert _controls(driver)["lora_scales"] == {"ink": 0.7}
    driver.execute_script("const r = document.getElementById('lora-0-range'); r.value = 0.3;"
                          "r.dispatchEvent(new Event('input')); r.dispatchEvent(new Event('change'));")
    wait("LoRA scale 0.3", lambda: _controls(driver)["lora_scales"] == {"ink": 0.3})
    # The engine was told (the pass-through engine keeps the live parameters it is sent, and reports them).
    wait("the engine's LoRA scale",
         lambda: js(driver, "(window.loom.state.session.params || {}).lora_scales") == {"ink": 0.3})

    from selenium.webdriver.common.keys import Keys

    box = driver.find_element("id", "lora-0")
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys("9", Keys.ENTER)
    line = driver.find_element("id", "message")
    message = wait("the refusal of 9 on the page", lambda: line.text if "refused" in line.get_attribute("class")
                   and "9" in line.text else None)
    assert "lora" in message.lower() and "[-4, 4]" in message, message
    assert _controls(driver)["lora_scales"] == {"ink": 0.3}
    _more_frames(show)


def _shown(driver, ids: tuple[str, ...]) -> dict[str, bool]:
    return {i: driver.find_element("id", i).is_displayed() for i in ids}


def test_an_engine_that_takes_no_steps_or_noise_scale_gets_no_such_controls_on_its_page(show):
    """An edit-family engine (-c edit-tiny) takes no steps, noise scale, motion-aware noise or transition chunks:
    once it has said what it takes, its page offers none of them (each would only be refused), and still its prompt
    box, and its adapter strength. This module's Wan engine takes them all, and its page offers them, but no adapter
    strength."""
    driver, first = show["driver"], show["driver"].current_window_handle
    wan = ("steps", "noise_scale", "motion_aware", "transition_chunks")
    ids = (*wan, "adapter_strength", "prompt")
    assert "steps" in wait("what the Wan engine takes", lambda: _controls(driver).get("takes"), proc=show["proc"])
    assert _shown(driver, ids) == {**dict.fromkeys(ids, True), "adapter_strength": False}
    log = show["tmp"] / "edit.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "loom_live.plugin.cli", "play", "-c", "edit-tiny", "-i",
                                 str(show["clip"]), "--mode", "live", "--loop", "-o", str(show["tmp"] / "edit.mp4"),
                                 "--web", "127.0.0.1:0", "--passthrough"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=err, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            url = wait("the edit run's page address", lambda: page_url(log), 60.0, proc)
            driver.switch_to.new_window("tab")
            open_page(driver, url, proc)
            takes = wait("what the edit engine takes", lambda: _controls(driver).get("takes"), proc=proc)
            assert "adapter_strength" in takes and "steps" not in takes and "noise_scale" not in takes
            assert _shown(driver, ids) == {**dict.fromkeys(wan, False), "adapter_strength": True, "prompt": True}
        finally:
            if driver.current_window_handle != first:
                driver.close()
                driver.switch_to.window(first)
            stop(proc)


def test_a_reference_upload_reaches_the_host_and_a_wrong_file_is_refused_on_the_page(show):
    """The page's reference picker (VACE): a PNG goes to the host, which decodes it and hands it on (this run's
    model, the embedded one, takes its input's edges as its only control, so the player refuses it in words);
    a text file never leaves the page."""
    import base64

    import cv2
    import numpy as np

    driver = show["driver"]
    png = base64.b64encode(cv2.imencode(".png", np.full((8, 8, 3), 90, np.uint8))[1].tobytes()).decode()
    driver.execute_script("const bytes = Uint8Array.from(atob(arguments[0]), (c) => c.charCodeAt(0));"
                          "uploadReference(new File([bytes], 'look.png', {type: 'image/png'}), 1 << 23);"
                          "uploadReference(new File(['hi'], 'notes.txt', {type: 'text/plain'}), 1 << 23);", png)
    wait("the upload taken by the host", lambda: "reference_image sent" in js(driver, "window.loom.accepted"))
    assert any("notes.txt: not a PNG or JPEG image" in r for r in js(driver, "window.loom.refusals"))
    wait("the player's answer", lambda: "reference: the model reads its input's edges only" in
         (_controls(driver).get("message") or ""))
    _more_frames(show)
