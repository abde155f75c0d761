"""The browser host's parts that need no browser: the frame stamp, who may open the page, and the
page's control messages as player commands (the browser itself: tests/integration/test_web_browser.py)."""

from __future__ import annotations

import os

import cv2
import numpy as np
import pytest

from loom_live.host_bridge.wire.errors import UserError
from loom_live.host_bridge.wire.params import ADAPTER_STRENGTH, EDIT_FAMILY_PARAMS, NOISE_SCALE, STEP_LISTS
from loom_live.plugin.player.controls import Command, ControlError, Controls, ControlState
from loom_live.plugin.web import stamp
from loom_live.plugin.web.access import make_access, parse_listen
from loom_live.plugin.web.page_controls import command_for, control_state, schema


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
    assert s["adapter_strength"] == {"min": 0.0, "max": 2.0, "step": 0.05, "ui_max": 2.0,
                                     "allowed": ADAPTER_STRENGTH.allowed()}


def test_the_page_is_told_what_the_engine_takes_and_which_parameter_each_control_sets():
    """The page hides a control whose parameter the running engine does not take (page.js, showTaken): an edit
    engine's state names its own parameters (the adapter strength among the page's) and none of the Wan ones; None
    (any may be sent) shows all."""
    params = schema()["params"]
    assert params == {"steps": "steps", "noise_scale": "noise_scale", "motion_aware": "motion_aware",
                      "lora_scale": "lora_scales", "transition_chunks": "transition_chunks",
                      "context_scale": "context_scale", "control_source": "control_source",
                      "adapter_strength": "adapter_strength"}
    controls = Controls(ControlState(prompts=["ink"]))
    assert control_state(controls.state)["takes"] is None
    edit = {"prompt": "make it ink", "params": {p.name: p.default for p in EDIT_FAMILY_PARAMS}, "family": "edit"}
    controls.follow_engine(edit)
    state = control_state(controls.state)
    takes = state["takes"]
    assert state["adapter_strength"] == ADAPTER_STRENGTH.default
    assert takes == sorted(p.name for p in EDIT_FAMILY_PARAMS) and set(takes) & set(params.values()) == \
        {"adapter_strength"}
    assert control_state(ControlState(prompts=["ink"], takes=frozenset()))["takes"] == []  # served, not said yet


def test_page_messages_become_player_commands():
    assert command_for({"control": "steps", "value": 3}) == Command("steps", (3,))
    assert command_for({"control": "noise_scale", "value": 0.5}) == Command("noise_scale", (0.5,))
    assert command_for({"control": "prompt", "text": " ink wash "}) == Command("prompt", ("ink wash", None))
    assert command_for({"control": "pause", "value": True}) == Command("pause", (True,))
    assert command_for({"control": "transition_chunks", "value": 0}) == Command("transition_chunks", (0,))
    assert command_for({"control": "lora_scale", "name": "ink", "value": 0.5}) == Command("lora_scale", ("ink", 0.5))
    assert command_for({"control": "adapter_strength", "value": 0}) == Command("adapter_strength", (0.0,))


@pytest.mark.parametrize("message, words", [
    ({"control": "noise_scale", "value": 5}, "[0.1, 1]"),
    ({"control": "steps", "value": 7}, "expected 1, 2, 3 or 4"),
    ({"control": "prompt", "text": "  "}, "the prompt is empty"),
    ({"control": "motion_aware", "value": "yes"}, "true or false"),
    ({"control": "transition_chunks", "value": -1}, "transition_chunks"),
    ({"control": "prompt_index", "value": 1.5}, "whole number"),
    ({"control": "steps", "value": "nan"}, "not a finite number"),
    ({"control": "transition_chunks", "value": 1e999}, "not a finite number"),
    ({"control": "quit"}, "unknown control 'quit'"),
    ({"control": "steps", "value": 10 ** 400}, "expected 1, 2, 3 or 4"),  # JSON ints have no bound; floats do
    ({"control": "noise_scale", "value": 10 ** 400}, "[0.1, 1]"),
    ({"control": "adapter_strength", "value": 2.5}, "adapter_strength: '2.5' is not allowed; expected a number in "
                                                    "[0, 2]"),
    ({"control": "adapter_strength", "value": "strong"}, "adapter_strength: 'strong' is not a number"),
    ({"value": 1}, "unknown control"),
])
def test_a_bad_page_message_is_refused_in_words(message, words):
    with pytest.raises(ControlError, match=None) as refused:
        command_for(message)
    assert words in str(refused.value)


def test_an_empty_prompt_from_the_page_is_refused_in_the_words_of_the_run_s_model_family():
    """An edit model's prompt is an instruction: the page was asked for "a few words describing the style"."""
    pytest.importorskip("aiortc", reason="the web extra")
    from loom_live.plugin.web.host import WebHost

    host = WebHost(make_access("127.0.0.1:0"), Controls(ControlState(prompts=["a"], family="edit")), (32, 24), 10.0)
    with pytest.raises(ControlError, match="the prompt is empty; give an instruction, such as 'make it a watercolor"):
        host.control({"control": "prompt", "text": "  "})
    assert host.control({"control": "prompt", "text": "make it ink"}) == "prompt sent"


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


# --- the web path's latency parts: frames released at their last packet, latest wins -------------------------


def _rtp(seq: int, timestamp: int, marker: int, data: bytes) -> object:
    from aiortc.rtp import RtpPacket

    packet = RtpPacket(payload_type=96, marker=marker, sequence_number=seq, timestamp=timestamp)
    packet._data = data  # what aiortc's receiver sets after depayloading
    return packet


def test_a_camera_frame_is_released_at_its_marked_last_packet_not_a_frame_later():
    pytest.importorskip("aiortc", reason="the web extra")
    from aiortc.jitterbuffer import JitterBuffer

    from loom_live.plugin.web.frame_release import MarkerJitterBuffer

    ours, aiortcs = MarkerJitterBuffer(), JitterBuffer(capacity=512, is_video=True)
    frame = [_rtp(100, 9000, 0, b"ab"), _rtp(101, 9000, 0, b"cd"), _rtp(102, 9000, 1, b"ef")]
    assert [ours.add(p)[1] for p in frame[:2]] == [None, None]
    released = ours.add(frame[2])[1]
    assert released is not None and released.data == b"abcdef" and released.timestamp == 9000
    assert all(aiortcs.add(p)[1] is None for p in frame)  # aiortc's own waits for the next frame's first packet
    late = aiortcs.add(_rtp(103, 12000, 0, b"gh"))[1]
    assert late is not None and late.data == b"abcdef"
    # The next frame, its packets out of order: released once the gap is filled.
    assert ours.add(_rtp(104, 12000, 1, b"kl"))[1] is None
    released = ours.add(_rtp(103, 12000, 0, b"ij"))[1]
    assert released is not None and released.data == b"ijkl"
    # A frame whose marked packet was lost: aiortc's rule releases it when the next frame begins.
    assert ours.add(_rtp(105, 15000, 0, b"mn"))[1] is None
    released = ours.add(_rtp(107, 18000, 1, b"pq"))[1]
    assert released is None  # 106 is missing: nothing is known whole yet
    released = ours.add(_rtp(106, 18000, 0, b"o"))[1]
    assert released is not None and released.data == b"mn"


def test_the_buffer_goes_into_each_video_receiver_of_a_real_peer():
    pytest.importorskip("aiortc", reason="the web extra")
    import asyncio

    from aiortc import RTCPeerConnection

    from loom_live.plugin.web import frame_release

    async def swap() -> tuple[int, list]:
        pc = RTCPeerConnection()
        pc.addTransceiver("video", direction="recvonly")
        pc.addTransceiver("audio", direction="recvonly")
        swapped = frame_release.install(pc)
        kinds = [type(getattr(t.receiver, frame_release._ATTRIBUTE)).__name__ for t in pc.getTransceivers()]
        await pc.close()
        return swapped, kinds

    assert asyncio.run(swap()) == (1, ["MarkerJitterBuffer", "JitterBuffer"])


def test_the_host_reads_the_newest_camera_frame_and_skips_the_stale_ones():
    pytest.importorskip("aiortc", reason="the web extra")
    import asyncio

    from aiortc.rtcrtpreceiver import RemoteStreamTrack
    from av import VideoFrame

    from loom_live.plugin.web.tracks import read_camera

    async def read() -> tuple[list[int], int]:
        track = RemoteStreamTrack(kind="video")
        for value in (10, 20, 30):  # three decoded frames waiting: the host was busy
            await track._queue.put(VideoFrame.from_ndarray(np.full((16, 16, 3), value, np.uint8), format="rgb24"))
        await track._queue.put(None)  # and the track's end
        got: list[int] = []
        skipped = await read_camera(track, lambda a: got.append(int(a[0, 0, 0])))
        return got, skipped

    got, skipped = asyncio.run(read())
    assert skipped == 2 and len(got) == 1 and abs(got[0] - 30) <= 2, got  # 10 and 20 stale: only 30 goes on


def test_a_page_without_a_token_must_name_this_machine_and_a_bad_value_keeps_its_socket():
    """Loopback asks no token, so the page's name is the guard: a site whose name a DNS rebinding points at
    127.0.0.1 is same-origin with itself and would drive the show. A value no setting takes (NaN) is
    refused on the page's socket, which stays open."""
    pytest.importorskip("aiortc", reason="the web extra")
    import asyncio

    import aiohttp

    from loom_live.plugin.web.host import WebHost

    controls = Controls(ControlState(prompts=["a", "b"]))
    host = WebHost(make_access("127.0.0.1:0"), controls, (32, 24), 10.0, camera=False)
    host.start()
    port = host.server.port

    async def visit() -> list:
        seen = []
        async with aiohttp.ClientSession() as session:
            for name in (f"evil.example:{port}", f"127.0.0.1.nip.io:{port}"):
                async with session.get(f"http://127.0.0.1:{port}/", headers={"Host": name}) as r:
                    seen.append((r.status, "open it at 127.0.0.1" in await r.text()))
            for name in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
                async with session.get(f"http://127.0.0.1:{port}/", headers={"Host": name}) as r:
                    seen.append(r.status)
            async with session.ws_connect(f"http://127.0.0.1:{port}/ws") as ws:
                await ws.send_json({"type": "control", "control": "steps", "value": "nan"})
                await ws.send_json({"type": "control", "control": "noise_scale", "value": 0.5})
                replies = []
                while len(replies) < 2:
                    msg = await asyncio.wait_for(ws.receive_json(), 10)
                    if msg["type"] in ("accepted", "refused"):
                        replies.append(msg["type"])
                seen.append(replies)
        return seen

    try:
        assert asyncio.run(visit()) == [(403, True), (403, True), 200, 200, 200, ["refused", "accepted"]]
    finally:
        host.close()
    assert host.server._broadcaster.done()  # ended, not left pending ("Task was destroyed" at exit)


def test_a_hostile_page_message_is_refused_and_counted_and_the_socket_and_the_state_go_on():
    """JSON nested too deeply for Python's parser and a binary message are refused to the page in words and
    counted; a report of NaN (which Python's json takes) stays out of the state, which every page must parse."""
    pytest.importorskip("aiortc", reason="the web extra")
    import asyncio
    import json

    import aiohttp

    from loom_live.plugin.web.host import WebHost

    host = WebHost(make_access("127.0.0.1:0"), Controls(ControlState(prompts=["a"])), (32, 24), 10.0, camera=True)
    host.start()

    def strict(text: str) -> dict:  # as a browser's JSON.parse: no NaN or Infinity
        return json.loads(text, parse_constant=lambda word: pytest.fail(f"{word} in a message to the page"))

    async def visit() -> tuple[list, dict]:
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"http://127.0.0.1:{host.server.port}/ws") as ws:
                await ws.send_str("[" * 100_000 + "]" * 100_000)
                await ws.send_bytes(b"\x00\x01")
                await ws.send_str('{"type": "report", "glass_to_glass_ms": NaN, "samples": Infinity}')
                await ws.send_json({"type": "offer", "sdp": None})
                await ws.send_json({"type": "offer", "sdp": "v=0\r\nnot an offer"})
                await ws.send_json({"type": "control", "control": "noise_scale", "value": 0.5})
                replies, state = [], None
                while state is None:
                    msg = strict(await asyncio.wait_for(ws.receive_str(), 5))
                    if msg["type"] in ("accepted", "refused"):
                        replies.append((msg["type"], msg["message"]))
                    elif msg["type"] == "state" and len(replies) == 5:
                        state = msg
                return replies, state

    try:
        replies, state = asyncio.run(visit())
    finally:
        host.close()
    offer = "expected the offer of the page's RTCPeerConnection"
    assert replies[:3] == [("refused", "not JSON (or nested too deeply); expected a JSON object"),
                           ("refused", "a binary message; expected JSON text"),
                           ("refused", "WebRTC offer refused: its sdp is not a session description (one starts "
                                       f"'v=0'); {offer}")]
    assert replies[3][0] == "refused" and replies[3][1].startswith("WebRTC offer refused (") and \
        replies[3][1].endswith(offer), replies[3]
    assert replies[4] == ("accepted", "noise_scale sent")
    assert state["refused"] == 4 and state["page"] == {}


def test_a_message_over_the_size_limit_closes_its_page_saying_why_and_is_counted(monkeypatch, caplog):
    """aiohttp closes a socket whose message is over the limit (1009); the log says which page and why, and the
    state counts it with the other refusals."""
    pytest.importorskip("aiortc", reason="the web extra")
    import asyncio
    import time

    import aiohttp

    from loom_live.plugin.web import server
    from loom_live.plugin.web.host import WebHost

    monkeypatch.setattr(server, "MAX_MESSAGE_BYTES", 1000)
    host = WebHost(make_access("127.0.0.1:0"), Controls(ControlState(prompts=["a"])), (32, 24), 10.0, camera=True)
    host.start()

    async def visit() -> int:
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"http://127.0.0.1:{host.server.port}/ws") as ws:
                await ws.send_str("x" * 2000)
                while (msg := await asyncio.wait_for(ws.receive(), 5)).type != aiohttp.WSMsgType.CLOSE:
                    pass
                return msg.data

    try:
        with caplog.at_level("WARNING", logger=server.__name__):
            assert asyncio.run(visit()) == 1009
            deadline = time.monotonic() + 5
            while host.server._pages and time.monotonic() < deadline:  # the server's side of the page ends
                time.sleep(0.01)
    finally:
        host.close()
    assert host.server.refused == 1
    assert any("page 1" in r.message and "exceeds limit 1000" in r.message for r in caplog.records), caplog.text


def test_a_jpeg_that_plants_a_small_frame_header_behind_a_marker_without_length_is_read_as_the_decoder_does():
    """TEM and RSTn carry no length. Read as if they did, the side check would skip the real frame header
    (16000x16000, gigabytes once decoded) and read a small one planted after the image's end."""
    import base64
    import struct

    from loom_live.plugin.player.reference_image import image_sides
    from loom_live.plugin.web.reference_upload import decode_upload

    ok, encoded = cv2.imencode(".jpg", np.full((16, 16, 3), 128, np.uint8))
    real = bytearray(encoded.tobytes())
    sof = real.find(b"\xff\xc0")
    real[sof + 5:sof + 9] = struct.pack(">HH", 16000, 16000)
    crafted = b"\xff\xd8\xff\x01" + bytes(real[2:])  # TEM right after the start
    crafted += b"\x00" * (4 + 0xFFE0 - len(crafted))  # where a walk that took TEM for a length would land
    crafted += b"\xff\xc0\x00\x11\x08" + struct.pack(">HH", 16, 16) + bytes(11)
    assert image_sides(crafted) == (16000, 16000)
    with pytest.raises(ControlError, match="16000x16000; expected 1 to 4096 px a side"):
        decode_upload("bomb.jpg", base64.b64encode(crafted).decode())
    assert decode_upload("fine.jpg", base64.b64encode(encoded.tobytes()).decode())[1].shape == (16, 16, 3)


def test_the_pages_get_each_restyled_frame_once_stamped_and_never_an_older_one():
    pytest.importorskip("aiortc", reason="the web extra")
    import asyncio

    from loom_live.plugin.web.host import WebHost

    host = WebHost(make_access("127.0.0.1:0"), Controls(ControlState(prompts=["a"])), (32, 24), 10.0)
    loop = asyncio.new_event_loop()
    try:
        host._boards(loop)
        board = host.output_board
        frames = {seq: np.full((24, 32, 3), 10 * seq, np.uint8) for seq in range(1, 5)}
        for seq in range(1, 5):
            host.submitted(seq)
        host._post(frames[3], 3)  # the follower got 3 first
        assert board.version == 1 and host._last_seq == 3
        host.output(frames[3], 3)  # the player shows 3 as well: not sent again
        host.output(frames[2], 2)  # an older frame: never sent after a newer one
        assert board.version == 1
        host.output(np.zeros((48, 64, 4), np.uint8), -1)  # a fallback picture of another size: fitted, sent
        assert board.version == 2 and board._frame.shape == (24 + stamp.STAMP_ROWS, 32, 3)
        host._post(frames[4], 4)
        assert board.version == 3 and int(board._frame[0, 0, 0]) == 40
        assert set(host.times.medians_ms()) == {"submit_to_post"}
        assert not host._stamps  # every stamp up to the newest sent is let go
    finally:
        loop.close()


# --- STUN and TURN servers ------------------------------------------------------------------------------------


def test_ice_servers_for_the_page_and_the_host(tmp_path):
    from loom_live.plugin.web.ice import ice_servers, rtc_configuration

    assert ice_servers([]) == [] and rtc_configuration([]) is None
    assert ice_servers(["stun:stun.example.org", "stun:[::1]:3478"]) == [
        {"urls": "stun:stun.example.org"}, {"urls": "stun:[::1]:3478"}]
    secret = tmp_path / "turn"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    turn = ice_servers(["turn:relay.example.org:3478?transport=tcp"], username="vj", credential_file=str(secret))
    assert turn == [{"urls": "turn:relay.example.org:3478?transport=tcp", "username": "vj", "credential": "s3cret"}]
    from_env = ice_servers(["turns:relay.example.org"], username="vj", env={"LOOM_ICE_CREDENTIAL": "e"})
    assert from_env[0]["credential"] == "e"
    pytest.importorskip("aiortc", reason="the web extra")
    from aiortc.rtcicetransport import connection_kwargs

    kwargs = connection_kwargs(rtc_configuration(ice_servers(["stun:127.0.0.1:3478"]) + turn).iceServers)
    assert kwargs["stun_server"] == ("127.0.0.1", 3478) and kwargs["turn_server"] == ("relay.example.org", 3478)
    assert (kwargs["turn_username"], kwargs["turn_password"], kwargs["turn_transport"]) == ("vj", "s3cret", "tcp")


@pytest.mark.parametrize("urls, extra, words", [
    (["http://stun.example.org"], {}, "expected stun:HOST"),
    (["stun:"], {}, "expected stun:HOST"),
    (["stun:host:99999"], {}, "not a port"),
    (["stun:host?transport=udp"], {}, "takes no ?transport="),
    (["turn:relay.example.org"], {}, "needs --ice-username NAME and a credential"),
    (["turn:relay.example.org"], {"username": "vj"}, "LOOM_ICE_CREDENTIAL"),
    (["stun:host"], {"username": "vj"}, "they are for a TURN server"),
])
def test_a_bad_ice_server_is_refused_in_one_line(urls, extra, words):
    from loom_live.plugin.web.ice import ice_servers

    with pytest.raises(UserError) as refused:
        ice_servers(urls, env={}, **extra)
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_a_turn_credential_file_others_can_read_is_refused(tmp_path):
    from loom_live.plugin.web.ice import ice_servers

    loose = tmp_path / "turn"
    loose.write_text("s3cret\n")
    loose.chmod(0o644)
    with pytest.raises(UserError, match="--ice-credential-file .*chmod 600"):
        ice_servers(["turn:relay.example.org"], username="vj", credential_file=str(loose))


def test_loom_web_says_its_own_name_and_waits_for_a_page_without_calling_it_a_stall():
    """`loom web` is the player on the page's camera: its lines say `loom web`, and until a page sends its camera
    the status line says so (an 'input stalled' before any page was opened read as a fault)."""
    from types import SimpleNamespace

    from loom_live.plugin.player.app import Player
    from loom_live.plugin.player.options import WEB_CAMERA_INPUT, PlayerOptions

    assert PlayerOptions(input=WEB_CAMERA_INPUT).command == "loom web" and PlayerOptions().command == "loom play"
    camera = SimpleNamespace(received=0)
    player = SimpleNamespace(opts=PlayerOptions(input=WEB_CAMERA_INPUT), web=SimpleNamespace(camera=camera))
    assert "waiting for a page's camera" in Player._stall_note(player)
    camera.received = 3  # a page came, then its camera stopped: that is a stall
    assert "input stalled" in Player._stall_note(player)
    assert "input stalled" in Player._stall_note(SimpleNamespace(opts=PlayerOptions(input="0"), web=None))


def test_a_jpeg_with_stray_bytes_before_a_marker_is_read_as_the_decoder_reads_it():
    """libjpeg skips bytes that are not a marker ("extraneous bytes before marker") and decodes the picture; the
    side check skips them too, so such a file (some cameras write them) is neither refused nor misread."""
    import base64
    import struct

    from loom_live.plugin.player.reference_image import image_sides
    from loom_live.plugin.web.reference_upload import decode_upload

    ok, encoded = cv2.imencode(".jpg", np.full((20, 30, 3), 90, np.uint8))
    raw = encoded.tobytes()
    after_first = 4 + struct.unpack(">H", raw[4:6])[0]
    stray = raw[:after_first] + b"\x00" + raw[after_first:]
    assert image_sides(stray) == (30, 20)
    assert decode_upload("stray.jpg", base64.b64encode(stray).decode())[1].shape == (20, 30, 3)


def test_the_pages_state_says_where_the_standby_is_and_nothing_without_one():
    """`loom web --standby`: the page's engine state carries the bridge's standby (page.js shows a badge only
    then)."""
    pytest.importorskip("aiortc", reason="the web extra")
    from types import SimpleNamespace

    from loom_live.host_bridge.bridge_stats import BridgeStatus
    from loom_live.host_bridge.supervisor import EngineState
    from loom_live.plugin.web.host import WebHost

    host = WebHost(make_access("127.0.0.1:0"), Controls(ControlState(prompts=["a"])), (32, 24), 10.0, camera=False)
    try:
        for standby in ("ready", ""):
            host.bridge = SimpleNamespace(status=lambda s=standby: BridgeStatus(state=EngineState.RUNNING, standby=s),
                                          stats=lambda: {})
            assert host.state()["engine"]["standby"] == standby
    finally:
        host.close()
