"""Loom's own Triton kernels build for the GPUs they are meant for, checked without a GPU: each kernel is
compiled ahead of time to PTX for Hopper (and Ada for FP8, Ampere for the sink write) wherever triton
is installed. Triton's interpreter, which the kernels' numeric tests use on a CPU, runs Python and
accepts what the compiler refuses (a plain module global, for one); this is the compiler's word."""

from __future__ import annotations

import textwrap

from tests.triton_child import run_triton

BUILD = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from loom_live.engine.cache import sink_write_kernel as sw
    from loom_live.engine.layers import row_quant_kernels as rq

    def build(fn, signature, constexprs, capabilities):
        for cc in capabilities:
            src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
            ptx = triton.compile(src, target=GPUTarget("cuda", cc, 32)).asm["ptx"]
            print(fn.__name__, cc, sorted(constexprs.items()), "ptx" if ".entry" in ptx else "no entry")

    rows = {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_out_ptr": "*fp32", "a_ptr": "*fp32", "b_ptr": "*fp32",
            "cols": "i32", "rows_per_mod": "i32", "eps": "fp32", "MODE": "constexpr", "TO_FP8": "constexpr",
            "BLOCK": "constexpr"}
    for mode in (rq.PLAIN, rq.GELU, rq.NORM_MODULATE, rq.NORM_AFFINE):  # every mode for Hopper, one for Ada
        build(rq._rows_kernel, rows, {"MODE": mode, "TO_FP8": True, "BLOCK": rq.MAX_ROW}, (89, 90)[mode != rq.PLAIN:])
    sink = {name: "*bf16" for name in ("k_sinks", "v_sinks", "k_new", "v_new")}
    sink.update({"hit": "*u8", "cos": "*fp32", "sin": "*fp32", "ROTATE": "constexpr", "BLOCK_T": "constexpr",
                 "BLOCK_C": "constexpr"})
    sink.update({n: "i32" for n in ("sinks", "tokens", "channels", "head_dim", "dt")})
    sink.update({n: "i64" for n in ("sb", "ss", "st", "kb", "kt", "vb", "vt")})
    for rotate in (False, True):  # both forms for Hopper, the rotating one (the whole body) for Ampere
        build(sw._masked_write, sink, {"ROTATE": rotate, "BLOCK_T": sw.BLOCK_T, "BLOCK_C": sw.BLOCK_C},
              (80, 90)[not rotate:])
""")


def test_the_kernels_compile_to_ptx_for_their_gpus(tmp_path):
    lines = run_triton(BUILD, interpret=False, cache_dir=tmp_path)  # a fresh cache: every kernel compiled here
    assert len(lines) == 4 + 1 + 2 + 1 and all(line.endswith(" ptx") for line in lines), lines
