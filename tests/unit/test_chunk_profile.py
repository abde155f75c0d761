"""The kernel profile's summary: per-chunk time by stream, family and kernel, and the GPU's busy time."""

from __future__ import annotations

import pytest

from loom_live.engine.tools.chunk_profile import family, profile_table, summarise
from loom_live.plugin.cli.main import main


def test_busy_time_merges_overlapping_streams_and_every_figure_is_per_chunk():
    kernels = [  # (name, stream, start us, duration us)
        ("sm90_xmma_fprop_implicit_gemm_bf16", 7, 0.0, 400.0),  # side stream: a convolution
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", 13, 100.0, 200.0),  # denoise: overlaps the conv
        ("triton_poi_fused_add_mul_0", 13, 1000.0, 100.0),  # alone, after a gap
        ("triton_poi_fused_add_mul_0", 13, 1500.0, 100.0),
    ]
    p = summarise(kernels, chunks=2)
    assert p["busy_ms"] == pytest.approx((400 + 100 + 100) / 2000)  # the overlap counted once, the gaps not
    assert p["wall_ms"] == pytest.approx(1600 / 2000)
    assert p["kernel_sum_ms"] == pytest.approx(800 / 2000)
    assert p["streams_ms"] == {"7": pytest.approx(0.2), "13": pytest.approx(0.2)}
    assert p["families_ms"]["convolution"] == pytest.approx(0.2)
    assert p["families_ms"]["matmul"] == pytest.approx(0.1)
    assert p["families_ms"]["elementwise (triton)"] == pytest.approx(0.1)
    top = p["top"][0]
    assert top["family"] == "convolution" and top["ms"] == pytest.approx(0.2) and top["calls"] == 0.5
    fused = next(k for k in p["top"] if k["name"].startswith("triton"))
    assert fused["calls"] == 1.0 and fused["ms"] == pytest.approx(0.1)
    table = profile_table(p)
    assert "GPU busy 0.30 ms of 0.80 ms" in table and "profile family convolution: 0.20 ms" in table


def test_kernel_families_by_name():
    assert family("flash_fwd_kernel") == "attention"
    assert family("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert family("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm>") == "matmul"
    assert family("void at::native::vectorized_elementwise_kernel<4>") == "elementwise (aten)"
    assert family("Memcpy DtoD (Device -> Device)") == "copy"
    # Inductor's: by what they compute, whatever ops they are named for
    assert family("triton_per_fused__to_copy_clamp_min_convolution_linalg_vector_norm_mul_silu_54") == \
        "elementwise (triton)"
    assert family("triton_poi_fused_cat_convolution_silu_56") == "elementwise (triton)"
    assert family("triton_poi_fused_as_strided_copy__slice_45") == "copy"
    assert family("triton_poi_fused_cat_clone_3") == "copy"
    assert family("some_new_kernel") == "other"
    assert summarise([], chunks=3)["busy_ms"] == 0.0


def test_bench_refuses_a_profile_it_cannot_take(capsys):
    import torch

    with pytest.raises(SystemExit) as usage:  # a count below 0: refused as the option's usage
        main(["bench", "--config", "tiny-random", "--profile-chunks", "-2"])
    assert usage.value.code == 2 and "expected an integer of 0 or more" in capsys.readouterr().err
    if not torch.cuda.is_available():  # on a CPU any profile is refused
        assert main(["bench", "--config", "tiny-random", "--frames", "8", "--bridge", "none",
                     "--profile-chunks", "4"]) == 2
        assert "--profile-chunks 4: a kernel profile needs a CUDA GPU" in capsys.readouterr().err
