#!/usr/bin/env bash
# Train the embedded model on a lent GPU machine, from the repository root:
#
#   bash tools/device_fit.sh NAME [loom train fit options...]
#
# The GPU machine is bare and sees only the checkout, so it needs, beside the tracked files:
# build/loom_styles_256.npz and build/loom_heldout_256.npz (`loom train prepare`, with and without
# --held-out, on the CPU in seconds) and, where its Python lacks pyzmq, that package's wheel in
# .whl/ (docs/embedded-model.md, Training). The weights, the log and the recipe go to $OUT/NAME
# (out/NAME without $OUT); the script ends by printing the log's last DiT lines and the VAE gate,
# so that the call's output says how the run went without fetching anything.
set -euo pipefail
name=${1:?usage: bash tools/device_fit.sh NAME [loom train fit options...]}
shift
for f in build/loom_styles_256.npz build/loom_heldout_256.npz; do
    [ -f "$f" ] || { echo "device_fit: $f is missing: run loom train prepare (see the header)" >&2; exit 2; }
done
source "$(dirname "$0")/device_env.sh"
out="${OUT:-out}/$name"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
python3 -m loom_live.engine.train fit --out "$out" "$@"
python3 - "$out/train_log.jsonl" <<'EOF'
import json
import sys

lines = [json.loads(line) for line in open(sys.argv[1])]
dit = [r for r in lines if r.get("phase") == "dit" and "loss" in r]
for r in dit[-5:]:
    print({k: r[k] for k in ("step", "loss", "steps", "batch") if k in r})
for r in lines:
    if r.get("phase") in ("vae_gate", "done", "dit_from") or r.get("out_of_memory"):
        print({k: v for k, v in r.items() if k != "rows"})
EOF
