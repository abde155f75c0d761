#!/usr/bin/env bash
# Run the GPU rows still open on a lent GPU machine, from the repository root:
#
#   bash tools/device_rows.sh GROUP [GROUP...]
#
# Groups, each bounded for a cold machine (a fresh machine has no compile cache: a 1.3B start-up
# takes about 60 s, the VACE layout's about 160 s): tests, embedded, speed, vae-fp16, attn, wide, fp8, fp8conv,
# fp8dit, fp8-14b, fp8-14b-compiled, thin, gelu, tune, 14b, vace, vace-batched, kernels, decode-paced,
# upsample, edit, edit-priority, edit-split, startup, cold, saved, sequential, lora, ipc, ipc-floor, ipc-queued, mps,
# cpu-awake, mps-standby, standby-share, td-cook, td-cook-wan, td-cook-mps, host-waits, recovery. A device call runs
# at most 10 minutes; groups whose limits add up to that or more (attn 1280 s, td-cook 1300, recovery 890, sequential 830,
# saved 750, edit 630, startup 620, edit-priority and lora 600) rely on their usual times, not their limits, to fit
# one call. Results (JSON and each run's output) go to $OUT/rows (out/rows without $OUT); the script prints each
# bench's summary table, so the call's output says how it went.
# The machine's Python may lack pyzmq: put its wheel in .whl/ (docs/embedded-model.md, Training).
set -uo pipefail
groups="tests embedded speed vae-fp16 attn wide fp8 fp8conv fp8dit fp8-14b fp8-14b-compiled thin gelu tune 14b vace vace-batched kernels decode-paced upsample edit edit-priority edit-split startup cold saved sequential lora ipc ipc-floor ipc-queued mps cpu-awake mps-standby standby-share td-cook td-cook-wan td-cook-mps host-waits recovery"
[ $# -gt 0 ] || { echo "usage: bash tools/device_rows.sh GROUP [GROUP...] (groups: $groups)" >&2; exit 2; }
for group in "$@"; do
    [[ " $groups " == *" $group "* ]] || { echo "device_rows: unknown group '$group' (groups: $groups)" >&2; exit 2; }
done
source "$(dirname "$0")/device_env.sh"
out="${OUT:-out}/rows"
mkdir -p "$out"
start=$(date +%s)

# One bounded command: its output to $out/NAME.txt, its summary table (or its tail) printed.
step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name (at $(( $(date +%s) - start )) s, limit $limit s)"
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    local rc=$?
    echo "   exit $rc"
    grep -E "^(FPS|latency|jitter|stage|preset|B=|encoder|model|wan2|no LoRA|2 LoRAs|LoRA /|a change|loom prepare)|start-up [0-9]|compile phases|first calls|passed|failed|error" "$out/$name.txt" | tail -24
    grep -E "^profile" "$out/$name.txt" | head -"${PROFILE_LINES:-40}"
    return $rc  # the command's status, so `step A && step B` runs B only after A succeeded
}
bench() { local name=$1 limit=$2; shift 2; step "$name" "$limit" python3 -m loom_live.plugin.cli bench --bridge none --no-baseline --json "$out/$name.json" "$@"; }
wan() { bench "$1" "$2" -c wan2.1-1.3b --steps 700 "${@:3}"; }
# bench_ipc_floor.py with spun notices (ipc-floor, ipc-queued), its table printed as it ends
floor() { step "$1" 290 python3 benchmarks/bench_ipc_floor.py --waits spin --json "$out/$1.json" "${@:2}"
    grep -A18 "form/wait" "$out/$1.txt"; }
# what `loom bench` and bench_recovery.py set: `loom prepare` keeps steps for the same layout
RANDOM_WEIGHTS=(--set model.random_weights=true --set vae.random_weights=true --set prompt.encoder=hash)
# the 14B FP8 stream, one step (fp8-14b, fp8-14b-compiled)
b14=(-c wan2.1-14b --steps 700 --frames 3000 --set model.fp8_linear=true)

# NVIDIA MPS for the groups that compare with it: a control daemon of this call's own (private pipe and log
# folders, so only processes started here with them join it), quit afterwards. MPS runs the processes' work in
# one GPU context instead of time-slicing one context each; it changes no card setting.
mps_on() {
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/loom_mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/loom_mps/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    trap 'echo quit | nvidia-cuda-mps-control' EXIT
    nvidia-cuda-mps-control -d && echo "   MPS daemon started"
}
mps_off() {
    [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] || return 0
    echo quit | nvidia-cuda-mps-control; trap - EXIT
    tail -4 "$CUDA_MPS_LOG_DIRECTORY"/control.log "$CUDA_MPS_LOG_DIRECTORY"/server.log 2>/dev/null
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

for group in "$@"; do
    case $group in
    tests)
        # the tests' many fresh processes share one bytecode cache (this machine's torch may carry none)
        step gpu_tests 540 env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/pycache_tests \
            python3 -m pytest -q -o addopts=-ra -m gpu tests/unit/test_canny.py \
            tests/unit/test_decode_priority.py tests/unit/test_dit_fused.py tests/unit/test_vae.py \
            tests/unit/test_sink_write_kernel.py tests/unit/test_row_quant_kernels.py tests/unit/test_lora_merge.py \
            tests/unit/test_saved_compiles.py \
            tests/integration/test_bridge_cuda.py tests/integration/test_cli.py tests/integration/test_touchdesigner.py \
            tests/integration/test_device_slots_gpu.py tests/integration/test_stream_host_waits_gpu.py \
            tests/integration/test_bench_ipc_floor.py ;;
    embedded)
        bench embedded 200 -c default --frames 3000 ;;
    speed)
        # issue 30's FPS rows over 3000 frames: 1 step (profiled), TAEHV both ways, 2 steps
        wan plain_3000 250 --frames 3000 --profile-chunks 8
        wan taehv_3000 120 --frames 3000 --encoder taehv --decoder taehv
        bench steps2_3000 170 -c wan2.1-1.3b --steps 700,500 --frames 3000 ;;
    vae-fp16)
        # the Wan VAE in float16 (vae.dtype) against bfloat16 on one machine: 1 step (profiled), 2 steps, then the
        # bfloat16 baseline at 1 step (last: a call cut short keeps the two rows' figures)
        wan half_3000 250 --frames 3000 --set vae.dtype=float16 --profile-chunks 8
        bench half2_3000 170 -c wan2.1-1.3b --steps 700,500 --frames 3000 --set vae.dtype=float16
        wan plain_1500 200 --frames 1500 ;;
    attn)
        # the DiT's self-attention over the window in parts, one q/k/v product, and the VAE's wide head as matrix
        # products: the GPU tests, the kernels and the DiT alone, then the 1-step, TAEHV and 2-step streams with
        # the forms that won
        step attn_test 150 python3 -m pytest -q -o addopts=-ra -m gpu tests/unit/test_attention_forms.py \
            tests/unit/test_fused_projections.py tests/unit/test_vae.py
        step attn_bench 150 python3 benchmarks/bench_attention.py --json "$out/attn_bench.json"
        tail -20 "$out/attn_bench.txt"
        forms=$(python3 - "$out/attn_bench.json" <<'PY' || echo "1 kernel"
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
window = [r for r in rows if r["table"] == "window" and r["heads"] == 12 and r["queries"] == 1560]
vae = [r for r in rows if r["table"] == "vae" and r["frames"] == 1]
print(min(window, key=lambda r: r["ms"])["splits"], min(vae, key=lambda r: r["ms"])["form"])
PY
)
        read -r splits vae_attention <<<"$forms"
        # the DiT alone (graphs, fused ops, B=1): as it is, with the split, with the split and one q/k/v product
        dit=(python3 benchmarks/bench_dit.py --graphs --fuse --batches 1)
        step dit_base 150 "${dit[@]}" --json "$out/dit_base.json"
        step dit_split 150 "${dit[@]}" --splits "$splits" --json "$out/dit_split.json"
        step dit_qkv 150 "${dit[@]}" --splits "$splits" --fuse-qkv --json "$out/dit_qkv.json"
        grep -h -A2 "median ms" "$out"/dit_{base,split,qkv}.txt
        qkv=$(python3 - "$out" <<'PY' || echo false
import json, sys
ms = {n: json.load(open(f"{sys.argv[1]}/dit_{n}.json"))["results"][0]["ms_median"] for n in ("split", "qkv")}
print(str(ms["qkv"] < ms["split"]).lower())
PY
)
        echo "   model.attention_splits=$splits vae.attention=$vae_attention model.fuse_qkv=$qkv"
        forms=(--set model.attention_splits="$splits" --set vae.attention="$vae_attention" --set model.fuse_qkv="$qkv")
        wan plain_attn 240 --frames 3000 "${forms[@]}" --profile-chunks 8
        wan taehv_attn 120 --frames 3000 --encoder taehv --decoder taehv "${forms[@]}"
        bench steps2_attn 170 -c wan2.1-1.3b --steps 700,500 --frames 3000 "${forms[@]}" ;;
    wide)
        # the full-resolution 96-channel convs as 2D convs over stacked frames, in the chunk and in the stream
        step vae_wide 300 python3 benchmarks/bench_vae_switches.py --tables chunk --variants \
            phase+cl+stack+taps+compile+graph,phase+cl+stack+taps+wide+compile+graph --json "$out/vae_wide.json"
        tail -4 "$out/vae_wide.txt"
        wan plain_wide 240 --frames 3000 --set vae.thin_convs=wide --profile-chunks 8 ;;
    fp8)
        # the 14B's block linears in FP8 (its GEMMs are 3.3x wider than the 1.3B's, where FP8 lost)
        bench b14_fp8 420 -c wan2.1-14b --steps 700 --frames 3000 --set model.fp8_linear=true --profile-chunks 8 ;;
    fp8conv)
        # cuDNN's e4m3 convolutions against bf16 at the VAE's conv shapes, each case in a child process of
        # its own (needs the nvidia-cudnn-frontend wheel in .whl/)
        step fp8_conv 400 python3 benchmarks/bench_fp8_conv.py --json "$out/fp8_conv.json"
        tail -16 "$out/fp8_conv.txt" ;;
    fp8dit)
        # the FP8 GPU tests (the one-pass row quantisation and the masked sink write among them, and the
        # compiled DiT against the eager one); the 14B DiT alone in FP8 as it is and with both kernels
        # (the masked sink merge, the one-pass quantisation): the floor under the 14B row's period
        step fp8_test 150 python3 -m pytest -q -o addopts=-ra -m gpu tests/unit/test_fp8_linear.py \
            tests/unit/test_row_quant_kernels.py tests/unit/test_sink_write_kernel.py tests/unit/test_dit_fused.py
        dit14=(python3 benchmarks/bench_dit.py --preset wan2.1-14b --graphs --fuse --batches 1 --fp8)
        step dit14_fp8 150 "${dit14[@]}" --json "$out/dit14_fp8.json"
        step dit14_fp8_triton 150 "${dit14[@]}" --masked-sink-merge --fp8-quantize triton \
            --json "$out/dit14_fp8_triton.json"
        grep -h -A2 "median ms" "$out"/dit14_fp8{,_triton}.txt ;;
    fp8-14b)
        # the 14B FP8 stream as configured by default (masked sink merge, one-pass row quantisation, the preset's
        # autotuned kernels: 30.91 FPS in session 22), then on Inductor's heuristic kernels, the 1.3B's default
        # since session 28: the pair the preset's autotune_kernels is decided on, both within one call's
        # 10 minutes (with the compiled quantisation's row between them it was about 14: `fp8-14b-compiled`)
        bench b14_fp8_triton 280 "${b14[@]}" --profile-chunks 8
        bench b14_fp8_heuristic 280 "${b14[@]}" --set model.autotune_kernels=false ;;
    fp8-14b-compiled)
        # the same stream with the compiled row quantisation, a call of its own
        bench b14_fp8_compiled 280 "${b14[@]}" --set model.fp8_quantize=compiled ;;
    thin)
        # the FFN's GELU epilogue at the 1-latent shape; the pixel-side convs alone and every form in the
        # chunk; then the stream with the form whose chunk was shortest
        step ffn_gelu 90 python3 benchmarks/bench_ffn_gelu.py --json "$out/ffn_gelu.json"
        tail -6 "$out/ffn_gelu.txt"
        step vae_thin 200 python3 benchmarks/bench_vae_switches.py --tables thin,chunk --variants \
            phase+cl+compile+graph,phase+cl+taps+compile+graph,phase+cl+stack+taps+compile+graph,phase+cl+stack+taps+wide+compile+graph \
            --json "$out/vae_thin.json"
        tail -16 "$out/vae_thin.txt"
        kinds=$(python3 - "$out/vae_thin.json" <<'PY' || echo taps
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["results"] if r["table"] == "chunk" and "total_ms" in r]
name = {"phase+cl+compile+graph": "none", "phase+cl+taps+compile+graph": "taps",
        "phase+cl+stack+taps+compile+graph": "both", "phase+cl+stack+taps+wide+compile+graph": "wide"}
print(name[min(rows, key=lambda r: r["total_ms"])["variant"]])
PY
)
        echo "   vae.thin_convs=$kinds"
        wan plain_thin 240 --frames 3000 --set vae.thin_convs="$kinds" --profile-chunks 8 ;;
    gelu)
        # the FFN's GELU epilogue on and off in the DiT-bound row (TAEHV both ways), 3000 frames each
        for g in true false; do wan "taehv_gelu_$g" 150 --frames 3000 --encoder taehv --decoder taehv \
            --set model.gelu_epilogue=$g; done ;;
    tune)
        # Inductor's coordinate-descent block sizes for the VAE's fused kernels: the chunk alone, then the stream
        step vae_tune 240 python3 benchmarks/bench_vae_switches.py --tables chunk --variants \
            phase+cl+stack+taps+compile+graph,phase+cl+stack+taps+compile+tune+graph --json "$out/vae_tune.json"
        tail -4 "$out/vae_tune.txt"
        wan plain_tuned 300 --frames 3000 --set vae.tune_kernels=true --profile-chunks 8 ;;
    14b)
        # issue 30's 14B row (target 30 FPS, jitter < 5 ms), 3000 frames, profiled
        bench b14 420 -c wan2.1-14b --steps 700 --frames 3000 --profile-chunks 8 ;;
    vace)
        bench vace 300 -c wan2.1-vace-1.3b --steps 700 --frames 1500 --profile-chunks 8
        wan plain 150 --frames 1500 --profile-chunks 8 ;;
    vace-batched)
        # the video and control encodes batched: worth it if a call on 2 streams costs well under 2 calls on 1
        for b in 1 2; do step "vae_batch$b" 120 python3 benchmarks/bench_vae.py --models wan2.1 \
            --variants cudnn+cl+graph --batch $b --json "$out/vae_batch$b.json"; done
        bench vace_batched 200 -c wan2.1-vace-1.3b --steps 700 --frames 1500 --set control.batched_encode=true ;;
    kernels)
        step ffn_gelu 120 python3 benchmarks/bench_ffn_gelu.py --json "$out/ffn_gelu.json" ;;
    decode-paced)
        for p in false true; do wan "decode_paced_$p" 150 --frames 1500 --input-fps 40 --set stream.decode_priority=$p; done ;;
    upsample)
        for u in nearest phase transposed; do wan "upsample_$u" 150 --frames 3000 --set vae.upsample=$u; done ;;
    edit)
        # B=16 first: its p99 is the row issue 35 sets a bound on, and its cold compile the longest
        bench edit_b16_prio_true 300 -c dreamlite-edit --batches 16 --frames 2000 --set edit.main_priority=true
        bench edit_b8 180 -c dreamlite-edit --batches 8 --frames 2000
        bench edit_b16_prio_false 150 -c dreamlite-edit --batches 16 --frames 2000 --set edit.main_priority=false ;;
    edit-priority)
        # after `edit` (compile cache warm): the main stream's priority off and on, alternating, twice
        for run in 1 2; do for p in false true; do
            bench "edit_b16_prio_${p}_$run" 150 -c dreamlite-edit --batches 16 --frames 2000 --set edit.main_priority=$p
        done; done ;;
    edit-split)
        # split 1 is edit_b16_prio_true above: the same config; the first run here compiles cold
        for s in 2 3; do bench "edit_b16_split_$s" 280 -c dreamlite-edit --batches 16 --frames 2000 --set edit.encoder_split=$s; done ;;
    startup)
        # cold (first on a fresh machine), then warm (Dynamo's automatic precompile, session 21, and
        # TORCH_WARM_POOL=0, session 23, were slower: not run)
        wan startup_cold 200 --frames 600
        wan startup_warm 150 --frames 600
        # what a process pays before its first phase ("the process ran N s before"), step by step: with
        # Python's bytecode kept as the engine keeps it (enable_bytecode_cache), then as installed
        step process_start 150 python3 benchmarks/bench_process_start.py --runs 3 --json "$out/process_start.json"
        tail -12 "$out/process_start.txt"
        step process_start_installed 120 python3 benchmarks/bench_process_start.py --runs 3 --upto compiler \
            --no-bytecode-cache --json "$out/process_start_installed.json"
        tail -12 "$out/process_start_installed.txt" ;;
    cold)
        # a cold start repeated on a warm machine (each variant a fresh process with empty compile caches; Python's
        # bytecode kept): where it goes (compile, Triton's compile waits and autotuning, the slowest steps), and
        # Triton timing several block sizes per kernel (model.autotune_kernels, off by default since session 28)
        step cold_start 590 python3 benchmarks/bench_cold_start.py --timeout 140 \
            --variants default,autotune --json "$out/cold_start.json"
        tail -6 "$out/cold_start.txt" ;;
    sequential)
        # two steps a chunk as one sequential pass (each cache row's forward a CUDA graph now): the graphed
        # sessions against ungraphed ones in both modes, then the stream against the stream-batch pipeline
        step graphs_test 150 python3 -m pytest -q -o addopts=-ra -m gpu tests/unit/test_step_graphs.py
        bench steps2_sequential 170 -c wan2.1-1.3b --steps 700,500 --frames 1500 --set stream.mode=sequential
        bench steps2_batch 170 -c wan2.1-1.3b --steps 700,500 --frames 1500 --set stream.mode=batch
        # paced below both rates: a frame's latency is then the pipeline's own depth (the batch pipeline's second
        # step comes at the next push), not the queue an unpaced bench keeps
        bench steps2_sequential_paced 170 -c wan2.1-1.3b --steps 700,500 --frames 1200 --input-fps 40 \
            --set stream.mode=sequential
        bench steps2_batch_paced 170 -c wan2.1-1.3b --steps 700,500 --frames 1200 --input-fps 40 \
            --set stream.mode=batch ;;
    saved)
        # compiled steps kept whole (after `startup`: every other graph a cache hit): a start with the folder
        # unused, a default start (load only) with nothing kept yet, `loom prepare` keeping them for bench's
        # config, then a default start that loads them
        wan startup_saved_none 150 --frames 600 --set vae.saved_steps=none --set model.saved_block_ops=none
        wan startup_saved_nothing_kept 150 --frames 600
        step prepare 300 python3 -m loom_live.plugin.cli prepare -c wan2.1-1.3b "${RANDOM_WEIGHTS[@]}" \
            --set "stream.steps=[700]"
        wan startup_saved_loaded 150 --frames 600 ;;
    lora)
        # a change spread over the merge's four parts, one a chunk (default), then over six (in one part: session 23)
        step lora 300 python3 benchmarks/bench_lora.py --frames 1200 --json "$out/lora.json"
        step lora_six_parts 300 python3 benchmarks/bench_lora.py --frames 1200 --set stream.lora_merge_parts=6 \
            --json "$out/lora_six_parts.json" ;;
    ipc)
        # the row's figures without the breakdown (its stamps and timed CUDA calls add to every step), the same with
        # the host's copies queued on its own stream (as the TouchDesigner operator's), then with the breakdown
        for s in 0 300; do
            for how in plain queued breakdown; do
                LOOM_DOORBELL_SPIN_US=$s step "ipc_${how}_spin$s" 150 python3 benchmarks/bench_ipc.py --transport \
                    cuda-ipc --size 1920x1080 --frames 500 --fps 60 --paced-frames 600 --json "$out/ipc_${how}_spin$s.json" \
                    $([ $how = plain ] || echo --$how)
                grep -A1 "^ *size  handoff" "$out/ipc_${how}_spin$s.txt" | tail -1  # the row: files may not all come back
            done
        done ;;
    ipc-floor)
        # the least any two-process split of the copies costs here (bench_ipc_floor.py), then the same under MPS
        # (spun notices only: a pipe's wake costs the same under every split)
        # (each form about 15 s: a fresh process, 500 frames back to back, 600 paced; the table grows as they end;
        # about 6 minutes in all)
        floor ipc_floor --warm-gpu
        if command -v nvidia-cuda-mps-control >/dev/null; then mps_on && floor ipc_floor_mps --warm-gpu; mps_off; fi ;;
    ipc-queued)
        # the least of ipc-floor that says whether copies queued ahead (behind marks that the other side's stream
        # writes) escape the paced frame's slow start: the one-process rows and two splits each ordered by events
        # and by marks, without and then under MPS (about 2.5 minutes)
        queued=(--forms host-copies engine-copies host-copies-gpu engine-copies-gpu)
        floor ipc_queued "${queued[@]}"
        if command -v nvidia-cuda-mps-control >/dev/null; then mps_on && floor ipc_queued_mps "${queued[@]}"; mps_off; fi ;;
    mps)
        # the paced handoff with the doorbell's window, then the same under NVIDIA MPS (mps_on, below)
        command -v nvidia-cuda-mps-control >/dev/null || { echo "   nvidia-cuda-mps-control: not on this machine"; continue; }
        # (--busy-host: the host's loop keeps its core working between frames, as a renderer's does)
        ipc_paced() { LOOM_DOORBELL_SPIN_US=300 step "$1" 150 python3 benchmarks/bench_ipc.py --transport cuda-ipc \
            --size 1920x1080 --frames 500 --fps 60 --paced-frames 600 --breakdown --json "$out/$1.json" "${@:2}"
            grep -A1 "^ *size  handoff" "$out/$1.txt" | tail -1; }
        ipc_paced ipc_no_mps
        ipc_paced ipc_no_mps_busy --busy-host
        mps_on && ipc_paced ipc_mps && ipc_paced ipc_mps_busy --busy-host
        mps_off ;;
    cpu-awake)
        # the paced handoff with the CPUs kept out of deep idle states (/dev/cpu_dma_latency held at 0 for the run)
        # beside the same without, then both under MPS; first the doorbell alone, and what the kernel says of idle
        for awake in "" --hold-cpu-awake; do
            step "doorbell${awake:+_awake}" 60 python3 benchmarks/bench_doorbell.py --notices 2000 --paced 600 $awake \
                --json "$out/doorbell${awake:+_awake}.json"; tail -3 "$out/doorbell${awake:+_awake}.txt"
        done
        awake_paced() { LOOM_DOORBELL_SPIN_US=300 step "$1" 150 python3 benchmarks/bench_ipc.py --transport cuda-ipc \
            --size 1920x1080 --frames 500 --fps 60 --paced-frames 600 --breakdown --json "$out/$1.json" "${@:2}"
            grep -A1 "^ *size  handoff" "$out/$1.txt" | tail -1; }  # the row itself: the call's files may not all come back
        awake_paced ipc_asleep
        awake_paced ipc_awake --hold-cpu-awake
        if command -v nvidia-cuda-mps-control >/dev/null; then
            mps_on && awake_paced ipc_mps_asleep && awake_paced ipc_mps_awake --hold-cpu-awake
            mps_off
        fi ;;
    mps-standby)
        # the hot standby's kills without and then under MPS, on one machine: do the host's reads still wait
        # while a new standby warms up beside the serving engine?
        command -v nvidia-cuda-mps-control >/dev/null || { echo "   nvidia-cuda-mps-control: not on this machine"; continue; }
        standby_kills() { step "$1" 250 python3 benchmarks/bench_recovery.py --modes standby --kills 2 --timeout 120 \
            --json "$out/$1.json"; grep -E "^standby " "$out/$1.txt"; }
        step prepare_standby 300 python3 -m loom_live.plugin.cli prepare -c wan2.1-1.3b "${RANDOM_WEIGHTS[@]}" \
            && standby_kills standby_no_mps && mps_on && standby_kills standby_mps
        mps_off ;;
    standby-share)
        # one kill each: a standby relaunched beside the show warming up whole, then resting to 0.3 of the time
        # (the default): the restyled frames the host finds while it loads, and when it is ready. Other shares:
        # STANDBY_SHARES="0.2 0.5"; under MPS: STANDBY_MPS=1
        step prepare_share 300 python3 -m loom_live.plugin.cli prepare -c wan2.1-1.3b "${RANDOM_WEIGHTS[@]}"
        [ -z "${STANDBY_MPS:-}" ] || mps_on
        for share in ${STANDBY_SHARES:-1 0.3}; do
            step "standby_share$share" 250 python3 benchmarks/bench_recovery.py --modes standby --kills 1 \
                --timeout 200 --standby-warmup-share $share --json "$out/standby_share$share.json"
            grep -E "^standby kill" "$out/standby_share$share.txt"
        done
        mps_off ;;
    td-cook | td-cook-wan | td-cook-mps)
        # the TouchDesigner operator's cook on cuda-ipc beside a pass-through engine, then beside a 1.3B engine on
        # the same GPU (its copies wait for the GPU's turns between contexts): copies queued against copies waited
        # for (--streamless), alternated; td-cook-mps: the same pair under MPS
        step prepare_td 300 python3 -m loom_live.plugin.cli prepare -c wan2.1-1.3b "${RANDOM_WEIGHTS[@]}"
        td_cook() { step "$1" 200 python3 benchmarks/bench_td_cook.py --transport cuda-ipc --json "$out/$1.json" \
            "${@:2}"; grep -E "^engine (outputs dropped|worker per frame|CUDA call)" "$out/$1.txt"
            grep -A2 "cooks     n" "$out/$1.txt"; }
        wan=(--config wan2.1-1.3b --seconds 15 --warmup-s 20 --start-s 180 --calls)
        if [ "$group" = td-cook-wan ]; then  # one pair beside the 1.3B engine, without MPS: td-cook-mps's match
            td_cook td_cook_wan_queued "${wan[@]}" && td_cook td_cook_wan_waited "${wan[@]}" --streamless
        elif [ "$group" = td-cook ]; then
            td_cook td_cook_passthrough --seconds 10
            for i in 1 2; do
                td_cook "td_cook_wan_queued$i" "${wan[@]}"
                td_cook "td_cook_wan_waited$i" "${wan[@]}" --streamless
            done
        elif command -v nvidia-cuda-mps-control >/dev/null; then
            mps_on && td_cook td_cook_wan_mps_queued "${wan[@]}" && td_cook td_cook_wan_mps_waited "${wan[@]}" --streamless
            mps_off
        fi ;;
    host-waits)
        # where the engine's frame path makes the host wait for the GPU: the cuda-ipc output write, a steady push
        step host_waits 300 python3 -m pytest -q -o addopts=-ra -m gpu tests/integration/test_device_slots_gpu.py \
            tests/integration/test_stream_host_waits_gpu.py ;;
    recovery)
        # restart, then the hot standby launched beside the first engine (its start: both engines ready),
        # two kills each; its engines load the steps `loom prepare` keeps for their config
        step prepare_recovery 300 python3 -m loom_live.plugin.cli prepare -c wan2.1-1.3b "${RANDOM_WEIGHTS[@]}"
        step recovery 590 python3 benchmarks/bench_recovery.py --modes restart,standby --kills 2 --timeout 150 \
            --json "$out/recovery.json" ;;  # a wait that hangs is an error row at 150 s, not a call cut with no JSON
    esac
done
echo "== done at $(( $(date +%s) - start )) s"
