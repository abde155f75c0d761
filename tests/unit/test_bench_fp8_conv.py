"""The FP8 conv bench's parts that need no GPU: a child case that crashes, hangs or fails becomes an error
entry and the bench goes on, per-tensor scaling is tried only after per-channel failed, and a graph whose
tensors differ from the torch tensors bound to them is refused before it executes."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from benchmarks.bench_fp8_conv import (
    Binding,
    LayoutMismatch,
    Outcome,
    bench_shape,
    conv_out_dims,
    cudnn_fp8_conv,
    distinct_shapes,
    layout_mismatches,
    outcome_of,
    run_case,
)

SHAPE = (96, 96, 4, 480, 832)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_child_that_aborts_becomes_a_crashed_entry_with_its_stderr_tail():
    code = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); "  # no core file
            "sys.stderr.write('x' * 500 + 'stage: execute\\nillegal address'); sys.stderr.flush(); os.abort()")
    out = run_case("3d/per-channel", SHAPE, command=_python(code), timeout=20)
    assert out.result is None
    assert out.error.startswith("crashed (exit -6): ")
    assert out.error.endswith("stage: execute | illegal address")
    assert len(out.error) < len("crashed (exit -6): ") + 300 + 10  # the tail, not all of stderr


def test_a_child_past_its_timeout_is_killed_and_recorded():
    code = "import sys, time; sys.stderr.write('stage: build'); sys.stderr.flush(); time.sleep(30)"
    out = run_case("taps/per-tensor", SHAPE, command=_python(code), timeout=0.5)
    assert out.result is None and out.error.startswith("timed out after 0.5 s")


def test_the_child_sees_cuda_launch_blocking_unless_turned_off():
    code = "import json, os; print(json.dumps({'result': {'v': os.environ.get('CUDA_LAUNCH_BLOCKING')}}))"
    assert run_case("bf16", SHAPE, command=_python(code), timeout=20).result == {"v": "1"}
    assert run_case("bf16", SHAPE, command=_python(code), timeout=20, launch_blocking=False).result == {"v": None}


def test_outcome_reads_the_last_json_line_and_treats_every_other_ending_as_an_error():
    ok = subprocess.CompletedProcess([], 0, 'cudnn says hi\n{"result": {"fp8_3d_ms": 1.5}, "notes": {"n": 1}}\n', "")
    assert outcome_of(ok) == Outcome(result={"fp8_3d_ms": 1.5}, notes={"n": 1})
    refused = subprocess.CompletedProcess([], 0, '{"error": "build: cudnnGraphNotSupportedError: no engine"}', "")
    assert outcome_of(refused).error == "build: cudnnGraphNotSupportedError: no engine"
    silent = outcome_of(subprocess.CompletedProcess([], 0, "", "stage: inputs\n"))
    assert silent.error == "no result (exit 0): stage: inputs"
    # a JSON line does not hide a non-zero exit
    failed = outcome_of(subprocess.CompletedProcess([], 1, '{"result": {}}', "Traceback\nboom"))
    assert failed.error == "crashed (exit 1): Traceback | boom"
    late = outcome_of(subprocess.TimeoutExpired(["x"], 60, output=b"", stderr=b"stage: timing"))
    assert late.error == "timed out after 60 s: stage: timing"


def _fake_run(answers: dict[str, Outcome], calls: list[str]):
    def run(case, shape):
        calls.append(case)
        return answers.get(case, Outcome(error="crashed (exit -6): illegal address"))
    return run


def test_per_tensor_runs_only_after_per_channel_failed_and_a_crash_loses_no_other_case():
    calls: list[str] = []
    answers = {
        "bf16": Outcome(result={"bf16_3d_ms": 2.0, "quantise_ms": 0.3}),
        "3d/per-channel": Outcome(result={"fp8_3d_ms": 1.2}, notes={"tensor_like": "matches"}),
        # taps/per-channel crashes (the default), taps/per-tensor works
        "taps/per-tensor": Outcome(result={"fp8_taps_ms": 1.4}),
    }
    row = bench_shape("dec full-res 96", SHAPE, _fake_run(answers, calls), progress=lambda *a: None)
    assert calls == ["bf16", "3d/per-channel", "taps/per-channel", "taps/per-tensor"]
    assert row["bf16_3d_ms"] == 2.0 and row["quantise_ms"] == 0.3
    assert row["fp8_3d_ms"] == 1.2 and row["fp8_3d_scales"] == "per-channel"
    assert row["fp8_3d_per-channel_tensor_like"] == "matches"
    assert row["fp8_taps_per-channel_error"] == "crashed (exit -6): illegal address"
    assert row["fp8_taps_ms"] == 1.4 and row["fp8_taps_scales"] == "per-tensor"
    assert "fp8_3d_per-tensor_error" not in row and "fp8_taps_per-tensor_error" not in row


def test_every_case_failing_leaves_an_error_entry_each_and_progress_one_line_each(capsys):
    calls: list[str] = []
    row = bench_shape("dec half-res 192", (192, 192, 4, 240, 416), _fake_run({}, calls))
    assert calls == ["bf16", "3d/per-channel", "3d/per-tensor", "taps/per-channel", "taps/per-tensor"]
    assert row["bf16_error"].startswith("crashed")
    assert {k for k in row if k.endswith("_error")} == {
        "bf16_error", "fp8_3d_per-channel_error", "fp8_3d_per-tensor_error", "fp8_taps_per-channel_error",
        "fp8_taps_per-tensor_error"}
    assert "fp8_3d_ms" not in row and "fp8_3d_scales" not in row
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 5
    assert lines[1] == "bench_fp8_conv: dec half-res 192 | 3d | per-channel | error: crashed (exit -6): illegal address"


def _binding(**changes) -> Binding:
    base = dict(name="x", graph_dim=[1, 96, 6, 4, 5], graph_stride=[11520, 1, 1920, 480, 96], graph_type="FP8_E4M3",
                shape=[1, 96, 6, 4, 5], stride=[11520, 1, 1920, 480, 96], dtype="torch.float8_e4m3fn", nbytes=11520)
    return Binding(**{**base, **changes})


def test_the_layout_check_passes_a_graph_tensor_that_is_its_torch_tensor():
    assert layout_mismatches([_binding()]) == []
    # a length-1 dim's stride never moves the address: [1, K, 1, 1, 1] descale with any stride there
    descale = _binding(name="descale", graph_dim=[1, 96, 1, 1, 1], graph_stride=[96, 1, 1, 1, 1],
                       graph_type="FLOAT", shape=[1, 96, 1, 1, 1], stride=[96, 1, 96, 96, 96], dtype="torch.float32",
                       nbytes=384)
    assert layout_mismatches([descale]) == []


def test_the_layout_check_names_each_mismatch():
    strides = layout_mismatches([_binding(graph_stride=[11520, 120, 20, 5, 1])])  # NCDHW against channels-last
    assert strides == ["x: graph strides [11520, 120, 20, 5, 1] != tensor strides [11520, 1, 1920, 480, 96]"]
    dims = layout_mismatches([_binding(name="y", graph_dim=[1, 96, 4, 4, 5])])
    assert dims == ["y: graph dims [1, 96, 4, 4, 5] != tensor shape [1, 96, 6, 4, 5]"]
    unset = layout_mismatches([_binding(graph_type="NOT_SET")])
    assert unset == ["x: graph data type NOT_SET != tensor torch.float8_e4m3fn (FP8_E4M3)"]
    # read as bf16, an e4m3 tensor's layout runs past its storage: twice its bytes
    wide = layout_mismatches([_binding(graph_type="BFLOAT16")])
    assert wide[1] == "x: the graph's layout reaches 23040 bytes, the tensor's storage holds 11520"
    assert layout_mismatches([_binding(nbytes=11519)]) == [
        "x: the graph's layout reaches 11520 bytes, the tensor's storage holds 11519"]


def test_conv_out_dims_and_distinct_shapes():
    assert conv_out_dims([1, 96, 6, 480, 832], [96, 96, 3, 3, 3], [0, 1, 1]) == [1, 96, 4, 480, 832]
    assert conv_out_dims([4, 288, 480, 832], [96, 288, 3, 3], [1, 1]) == [4, 96, 480, 832]
    shapes = distinct_shapes()
    assert [label for label, _ in shapes] == ["dec full-res 96", "dec half-res 192", "dec quarter-res 384"]
    assert distinct_shapes(limit=1) == [("dec full-res 96", (96, 96, 4, 480, 832))]


# --- the graph builder against a stand-in for the cuDNN frontend (CPU tensors; nothing executes on a GPU) ---

class _Type(SimpleNamespace):
    pass


_TYPES = SimpleNamespace(**{n: _Type(name=n) for n in ("FP8_E4M3", "BFLOAT16", "FLOAT", "NOT_SET")})


class _Tensor:
    def __init__(self, dim, stride, data_type):
        self.dim, self.stride, self.data_type = list(dim), list(stride), data_type

    def get_dim(self):
        return self.dim

    def get_stride(self):
        return self.stride

    def get_data_type(self):
        return self.data_type

    def set_output(self, _):
        return self

    def set_data_type(self, data_type):
        self.data_type = data_type
        return self


class _Graph:
    """Infers the conv's output as channels-last; `drop_types` plays a frontend that loses the FP8 type,
    `out_dims` one that infers the wrong output."""

    def __init__(self, executed, drop_types=False, out_dims=None, **_):
        self.executed, self.drop_types, self.out_dims = executed, drop_types, out_dims

    def tensor(self, name, dim, stride, data_type):
        return _Tensor(dim, stride, _TYPES.NOT_SET if self.drop_types and data_type is _TYPES.FP8_E4M3 else data_type)

    def conv_fprop(self, image, weight, padding, **_):
        dim = self.out_dims or conv_out_dims(image.dim, weight.dim, padding)
        return _Tensor(dim, torch.empty(dim).contiguous(memory_format=torch.channels_last_3d).stride(), None)

    def scale(self, input, scale):
        return _Tensor(input.dim, input.stride, None)

    def validate(self):
        pass

    build_operation_graph = check_support = build_plans = validate

    def create_execution_plans(self, _):
        pass

    def get_workspace_size(self):
        return 0

    def get_plan_name_at_index(self, _):
        return "fake_plan"

    def execute(self, pack, workspace, handle):
        self.executed.append(pack)


def _fake_cudnn(executed, **graph_options):
    return SimpleNamespace(data_type=_TYPES, heur_mode=SimpleNamespace(A="A", FALLBACK="FALLBACK"),
                           pygraph=lambda **kw: _Graph(executed, **graph_options, **kw))


def _fp8_inputs(per_channel: bool):
    cl3 = torch.channels_last_3d
    x8 = torch.zeros(1, 16, 4, 3, 5, dtype=torch.float8_e4m3fn).contiguous(memory_format=cl3)
    w8 = torch.zeros(32, 16, 3, 3, 3, dtype=torch.float8_e4m3fn).contiguous(memory_format=cl3)
    return x8, w8, torch.ones(32 if per_channel else 1)


@pytest.mark.parametrize("per_channel", [True, False])
def test_the_builder_binds_a_descale_in_the_layout_the_graph_declares(per_channel):
    executed: list[dict] = []
    x8, w8, descale = _fp8_inputs(per_channel)
    run, plan = cudnn_fp8_conv(_fake_cudnn(executed), None, x8, w8, descale, [0, 1, 1])
    assert plan == "fake_plan" and executed == []  # building executes nothing
    out = run()
    assert out.shape == (1, 32, 2, 3, 5) and out.dtype == torch.bfloat16
    (pack,) = executed
    scale = next(t for g, t in pack.items() if g.get_dim()[1] == descale.numel() and t.dtype == torch.float32)
    channels = descale.numel()
    assert list(scale.shape) == [1, channels, 1, 1, 1] and scale.stride() == (channels, 1, 1, 1, 1)
    for graph_tensor, tensor in pack.items():
        assert graph_tensor.get_dim() == list(tensor.shape)


def test_the_builder_refuses_a_graph_that_lost_the_fp8_type_before_anything_executes():
    executed: list[dict] = []
    x8, w8, descale = _fp8_inputs(per_channel=True)
    with pytest.raises(LayoutMismatch, match=r"x: graph data type NOT_SET != tensor torch.float8_e4m3fn"):
        cudnn_fp8_conv(_fake_cudnn(executed, drop_types=True), None, x8, w8, descale, [0, 1, 1])
    with pytest.raises(LayoutMismatch, match=r"y: graph dims \[1, 32, 4, 3, 5\] != the conv's output"):
        cudnn_fp8_conv(_fake_cudnn(executed, out_dims=[1, 32, 4, 3, 5]), None, x8, w8, descale, [0, 1, 1])
    assert executed == []
