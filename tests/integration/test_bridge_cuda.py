"""cuda-ipc between two real processes: device pointers in, device pointers out, content exact.

Run on a CUDA machine (`pytest -m gpu tests/integration/test_bridge_cuda.py`). The host side hands the bridge
raw device pointers (a torch tensor's data_ptr, as TouchDesigner hands `cudaMemory().ptr`); the
pass-through engine copies slot to slot on the GPU; nothing crosses the CPU.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from loom_live.host_bridge import Bridge, BridgeConfig, mps

ROOT = Path(__file__).resolve().parents[2]
N_FRAMES = 1000


@pytest.fixture(autouse=True)
def _cuda_ipc_available():
    from loom_live.host_bridge.wire.rings.cuda import cuda_available

    ok, why = cuda_available()
    if not ok:
        pytest.skip(f"cuda-ipc unavailable: {why} (install cuda-python matching the driver)")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_thousand_1080p_rgba_frames_round_trip_exactly_over_cuda_ipc(dtype):
    import torch

    h, w, c = 1080, 1920, 4
    tdt = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = (torch.randint(0, 256, (h, w, c), device="cuda", generator=gen, dtype=torch.int32).to(tdt)
            if dtype == "uint8" else torch.rand((h, w, c), device="cuda", generator=gen))
    src = torch.empty_like(base)
    dst = torch.empty_like(base)
    pitch = w * c * src.element_size()
    cfg = BridgeConfig(transport="cuda-ipc", passthrough=True, engine_cwd=str(ROOT))
    with Bridge(cfg) as bridge:
        bridge.wait_running(60)
        for i in range(N_FRAMES):
            if dtype == "uint8":
                src.copy_(((base.to(torch.int32) + i) % 256).to(torch.uint8))
            else:
                src.copy_(base + i)
            torch.cuda.synchronize()
            bridge.submit_cuda(src.data_ptr(), pitch, w, h, c, dtype, layout="touchdesigner")
            seq = bridge.last_seq
            assert bridge.wait_for_output(seq, 10), f"frame {i}: no output ({bridge.status()})"
            status = bridge.latest_cuda(dst.data_ptr(), pitch)
            assert status.seq >= seq and not status.fallback
            assert torch.equal(dst, src), f"frame {i} differs"
        stats = bridge.stats()
    assert stats["received"] >= N_FRAMES and stats["refused"] == 0


@pytest.mark.gpu
def test_cuda_ipc_numpy_frames_and_batch_process():
    frames = [np.random.default_rng(i).integers(0, 256, (64, 96, 3), dtype=np.uint8) for i in range(20)]
    cfg = BridgeConfig(transport="cuda-ipc", passthrough=True, engine_cwd=str(ROOT))
    with Bridge(cfg) as bridge:
        bridge.wait_running(60)
        outs = bridge.process(frames, timeout_s=60)
        assert all(np.array_equal(a, b) for a, b in zip(frames, outs))
        bridge.submit(frames[0])
        assert bridge.wait_for_output(bridge.last_seq, 10)
        out, status = bridge.latest()
        assert np.array_equal(out, frames[0]) and not status.fallback


@pytest.mark.gpu
def test_control_frames_travel_beside_device_frames_over_cuda_ipc():
    """VACE on the GPU path: each device frame with its control frame (TouchDesigner layout), staged on the
    device and copied into the two halves of one slot; the pass-through engine records what it got."""
    import torch

    from loom_live.host_bridge import DeviceFrame

    n, h, w, c = 8, 270, 480, 4
    gen = torch.Generator(device="cuda").manual_seed(1)
    frames = torch.randint(0, 256, (n, h, w, c), device="cuda", generator=gen, dtype=torch.int32).to(torch.uint8)
    frames[..., 3] = 255  # opaque: the engine's output comes back with an opaque alpha
    controls = 255 - frames
    dst = torch.empty_like(frames[0])
    pitch = w * c
    cfg = BridgeConfig(transport="cuda-ipc", passthrough=True, engine_cwd=str(ROOT))
    with Bridge(cfg) as bridge:
        bridge.wait_running(60)
        torch.cuda.synchronize()
        for i in range(n):
            bridge.submit_cuda(frames[i].data_ptr(), pitch, w, h, c, "uint8", layout="touchdesigner",
                               control=DeviceFrame(controls[i].data_ptr(), pitch, w, h, c, "uint8"))
            assert bridge.wait_for_output(bridge.last_seq, 10), f"frame {i}: no output ({bridge.status()})"
            assert not bridge.latest_cuda(dst.data_ptr(), pitch).fallback
            assert torch.equal(dst, frames[i]), f"frame {i} differs"
        bridge.set_params(noise_scale=0.5, wait=True)  # answered after the frames before it
        report = bridge.engine_report(refresh=True)["session"]["control"]
        stats = bridge.stats()
    assert report["frames"] == n and report["missing"] == 0
    assert report["sum"] == int(controls[..., :3].to(torch.int64).sum())  # the RGB of each control frame
    assert stats["refused_control"] == 0 and stats["refused"] == 0


@pytest.mark.gpu
def test_queued_copies_on_the_hosts_stream_hand_back_whole_frames_over_cuda_ipc():
    """TouchDesigner's cook path: `submit_cuda(keep=...)` and `latest_cuda(wait=False)` on the host's own
    stream, nothing waited for; each source a fresh allocation the host drops at once (the bridge holds it).
    Every frame read back, fallback or output, is one submitted frame whole, and the last one comes back."""
    import weakref

    import torch

    h, w, c, n, ring = 1080, 1920, 4, 240, 8  # n < 256: a frame's value names it
    gen = torch.Generator(device="cuda").manual_seed(2)
    base = torch.randint(0, 256, (h, w, c), device="cuda", generator=gen, dtype=torch.int32)
    outs = torch.empty((ring, h, w, c), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()  # `base` is made on the default stream, read on `stream`
    pitch = w * c
    kept = []

    def whole(frames: torch.Tensor) -> list[int]:
        """The frame value of each output (-1 for a frame that is not one submitted frame whole)."""
        offsets = (frames.to(torch.int32) - base) % 256
        first = offsets.flatten(1)[:, 0]
        return [int(v) if bool((o == v).all()) else -1 for o, v in zip(offsets, first)]

    cfg = BridgeConfig(transport="cuda-ipc", passthrough=True, engine_cwd=str(ROOT))
    with Bridge(cfg) as bridge, torch.cuda.stream(stream):
        bridge.wait_running(60)
        seen = []
        for i in range(n):
            src = ((base + i) % 256).to(torch.uint8)  # made on the host's stream
            kept.append(weakref.ref(src))
            bridge.submit_cuda(src.data_ptr(), pitch, w, h, c, "uint8", layout="touchdesigner",
                               stream=stream.cuda_stream, keep=src)
            del src
            bridge.latest_cuda(outs[i % ring].data_ptr(), pitch, stream=stream.cuda_stream, wait=False)
            if i % ring == ring - 1:
                stream.synchronize()
                seen += whole(outs)
                time.sleep(0.002)
        assert bridge.wait_for_output(bridge.last_seq, 10), bridge.status()
        status = bridge.latest_cuda(outs[0].data_ptr(), pitch, stream=stream.cuda_stream, wait=False)
        stream.synchronize()
        last = whole(outs[:1])[0]
        stats = bridge.stats()
    assert -1 not in seen, f"{seen.count(-1)} of {len(seen)} frames read back were torn"
    assert len(set(seen)) > n // 20  # the frames read back moved on with the input
    assert not status.fallback and last == (n - 1) % 256
    assert sum(ref() is not None for ref in kept) == 0  # closing the bridge let go of every source
    assert stats["refused"] == 0


@pytest.mark.gpu
def test_real_session_behind_the_bridge_streams_restyled_frames_over_cuda_ipc():
    """The whole product path: a host hands 480x832 device frames to a launched 1.3B-shaped engine.

    Loading compiles for a while and holds the engine's GIL; the bridge must neither kill it as
    hung nor block the host's frame loop, and once running it must return restyled frames
    (not the fallback) at a usable rate, with no restart.
    """
    import torch

    h, w, c = 480, 832, 4
    cfg = BridgeConfig(transport="cuda-ipc", engine_cwd=str(ROOT), engine_config="wan2.1-1.3b",
                       engine_overrides=["model.random_weights=true", "vae.random_weights=true",
                                         "prompt.encoder=hash", "stream.steps=[700]"])
    src = torch.zeros((h, w, c), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    pitch = w * c
    with Bridge(cfg) as bridge:
        status = bridge.wait_running(600)
        assert status.state == "running", status
        fresh = 0
        for i in range(300):
            src.fill_(i % 256)
            torch.cuda.synchronize()
            start = time.monotonic()
            bridge.submit_cuda(src.data_ptr(), pitch, w, h, c, "uint8", layout="touchdesigner")
            st = bridge.latest_cuda(dst.data_ptr(), pitch)
            assert time.monotonic() - start < 0.05, "the host's frame loop was blocked"
            if not st.fallback and st.seq > 0:
                fresh += 1
            time.sleep(1 / 30)
        stats = bridge.stats()
        print("bridge stats:", {k: stats[k] for k in ("received", "dropped", "fps", "latency_ms_p50",
                                                          "latency_ms_p99", "restarts")})
        assert stats["restarts"] == 0 and stats["refused"] == 0
        assert stats["received"] >= 100, stats
        assert fresh >= 200, f"only {fresh} of 300 host frames showed engine output"
        assert not torch.equal(dst, src), "the engine returned its input unchanged"


@pytest.mark.gpu
def test_cuda_ipc_round_trips_exactly_with_host_and_engine_under_one_mps_daemon(tmp_path):
    """README's "One GPU, several processes": under NVIDIA MPS the host and the engine it launches are
    clients of one daemon, sharing a GPU context; cuda-ipc's memory and events must still cross between
    them, content exact. A daemon of the test's own (private pipe folder), quit at the end; the host is a
    fresh process (this one's CUDA context predates the daemon)."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        pytest.skip("nvidia-cuda-mps-control (NVIDIA's driver utilities) is not on this machine")
    pipe, log = tmp_path / "pipe", tmp_path / "log"
    pipe.mkdir()
    log.mkdir()
    env = {**os.environ, mps.PIPE_ENV: str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(log)}
    subprocess.run([control, "-d"], env=env, check=True, timeout=30)
    try:
        assert mps.daemon_pipe(env) == pipe
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_ipc.py"), "--transport", "cuda-ipc",
                               "--size", "512x512", "--frames", "200", "--json", str(tmp_path / "ipc.json")],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
        logs = "\n".join(f"{f.name}:\n{f.read_text()}" for f in sorted(log.glob("*.log")))
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:] + logs[-3000:]
        clients = re.findall(r"Client \{PID: (\d+), Context ID: \d+\} connected", logs)
        assert len(set(clients)) >= 2, f"host and engine did not both join the daemon:\n{logs[-4000:]}"
    finally:
        subprocess.run([control], input="quit\n", env=env, text=True, timeout=30)
    stats = json.loads((tmp_path / "ipc.json").read_text())["bridge_stats"]
    assert stats["received"] >= 200 and stats["refused"] == 0 and stats["restarts"] == 0


@pytest.mark.gpu
def test_the_handoff_bench_with_the_hosts_copies_queued_brings_the_frame_back(tmp_path):
    """`bench_ipc.py --queued`: the TouchDesigner operator's way (copies queued on the caller's stream, the source
    kept meanwhile), back to back and paced; the bench checks the frame came back unchanged."""
    out = tmp_path / "ipc.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_ipc.py"), "--transport", "cuda-ipc",
                           "--size", "512x512", "--frames", "100", "--fps", "60", "--paced-frames", "30", "--queued",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["queued"] is True and "the host's copies queued" in proc.stdout
    assert result["sizes"]["512x512"]["handoff"]["n"] == 100 and result["sizes"]["512x512"]["handoff_paced"]["n"] == 30
    assert result["bridge_stats"]["refused"] == 0 and result["bridge_stats"]["restarts"] == 0
