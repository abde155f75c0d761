"""The browser host's parts that need no browser: the frame stamp, who may open the page, and the
page's control messages as player commands (the browser itself: tests/integration/test_web_browser.py)."""

from __future__ import annotations

import os

import cv2
import numpy as np
import pytest

from loom_live.host_bridge.wire.errors import UserError
from loom_live.host_bridge.wire.params import NOISE_SCALE, STEP_LISTS
from loom_live.plugin.player.controls import Command, ControlError, Controls, ControlState
from loom_live.plugin.web import stamp
from loom_live.plugin.web.access import make_access, parse_listen
from loom_live.plugin.web.page_controls import command_for, schema


@pytest.mark.parametrize("code", [1, 2, 1234, stamp.CODE_LIMIT - 1])
def test_a_stamp_reads_back_after_scaling_and_blur(code):
    strip = stamp.encode(code, 256)
    blurred = cv2.GaussianBlur(cv2.resize(strip, (96, 6), interpolation=cv2.INTER_AREA), (3, 3), 0)
    assert stamp.decode(strip) == code
    assert stamp.decode(blurred) == code


def test_a_blank_or_damaged_strip_reads_as_no_stamp():
    assert stamp.decode(stamp.encode(0, 128)) == 0
    damaged = stamp.encode(77, 128)
    damaged[:, 8:16] = 255 - damaged[:, 8:16]  # one data block flipped: the parity block no longer agrees
    assert stamp.decode(damaged) == 0
    assert stamp.decode(np.full((16, 128, 3), 255, np.uint8)) == 0  # no black end block


def test_listen_addresses():
    assert parse_listen("8080") == ("127.0.0.1", 8080)
    assert parse_listen("0.0.0.0:8443") == ("0.0.0.0", 8443)
    assert parse_listen("[::1]:9000") == ("::1", 9000)
    for bad in ("", "host", "host:port", "1.2.3.4:99999"):
        with pytest.raises(UserError, match="--web"):
            parse_listen(bad)


def test_loopback_needs_no_token_unless_a_token_file_is_given(tmp_path):
    open_page = make_access("127.0.0.1:0")
    assert open_page.token is None and open_page.allows(None) and open_page.url(8080) == "http://127.0.0.1:8080/"
    token_file = tmp_path / "token"
    guarded = make_access("8080", token_file=str(token_file))  # created, mode 600, with a random token
    assert oct(os.stat(token_file).st_mode & 0o777) == "0o600"
    assert guarded.token and guarded.allows(guarded.token) and not guarded.allows("wrong") and not guarded.allows(None)
    assert guarded.url().endswith(f"/?token={guarded.token}")


def test_another_address_needs_https_or_a_proxy_and_gets_a_printed_token(tmp_path):
    with pytest.raises(UserError, match="--web-cert"):
        make_access("0.0.0.0:8443")
    proxied = make_access("0.0.0.0:8443", proxy=True)
    assert proxied.token and len(proxied.token) >= 20 and proxied.scheme == "http"
    with pytest.raises(UserError, match="give both"):
        make_access("0.0.0.0:8443", cert=str(tmp_path / "c.pem"))
    with pytest.raises(UserError, match="cannot load"):
        make_access("0.0.0.0:8443", cert=str(tmp_path / "c.pem"), key=str(tmp_path / "k.pem"))
    loose = tmp_path / "loose"
    loose.write_text("a-token-that-others-can-read-0123\n")
    loose.chmod(0o644)
    with pytest.raises(UserError, match="chmod 600"):
        make_access("8080", token_file=str(loose))


def test_the_schema_is_the_live_parameters():
    s = schema()
    assert s["steps"] == sorted(STEP_LISTS)
    assert (s["noise_scale"]["min"], s["noise_scale"]["max"], s["noise_scale"]["step"]) == \
        (NOISE_SCALE.min, NOISE_SCALE.max, NOISE_SCALE.ui_step)


def test_page_messages_become_player_commands():
    assert command_for({"control": "steps", "value": 3}) == Command("steps", (3,))
    assert command_for({"control": "noise_scale", "value": 0.5}) == Command("noise_scale", (0.5,))
    assert command_for({"control": "prompt", "text": " ink wash "}) == Command("prompt", ("ink wash", None))
    assert command_for({"control": "pause", "value": True}) == Command("pause", (True,))
    assert command_for({"control": "transition_chunks", "value": 0}) == Command("transition_chunks", (0,))
    assert command_for({"control": "lora_scale", "name": "ink", "value": 0.5}) == Command("lora_scale", ("ink", 0.5))


@pytest.mark.parametrize("message, words", [
    ({"control": "noise_scale", "value": 5}, "[0.1, 1]"),
    ({"control": "steps", "value": 7}, "expected 1, 2, 3 or 4"),
    ({"control": "prompt", "text": "  "}, "the prompt is empty"),
    ({"control": "motion_aware", "value": "yes"}, "true or false"),
    ({"control": "transition_chunks", "value": -1}, "transition_chunks"),
    ({"control": "prompt_index", "value": 1.5}, "whole number"),
    ({"control": "quit"}, "unknown control 'quit'"),
    ({"value": 1}, "unknown control"),
])
def test_a_bad_page_message_is_refused_in_words(message, words):
    with pytest.raises(ControlError, match=None) as refused:
        command_for(message)
    assert words in str(refused.value)


def test_transition_chunks_reach_the_engine_and_later_prompts():
    sent: list = []

    class Bridge:
        def set_params(self, **p):
            sent.append(("params", p))

        def set_prompt(self, text, transition_chunks=None):
            sent.append(("prompt", text, transition_chunks))

    controls = Controls(ControlState(prompts=["a"]))
    controls.put(command_for({"control": "transition_chunks", "value": 0}))
    controls.put(command_for({"control": "prompt", "text": "b"}))
    controls.apply_pending(Bridge())
    assert ("prompt", "b", 0) in sent and ("params", {"transition_chunks": 0}) in sent
