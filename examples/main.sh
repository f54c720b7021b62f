#!/usr/bin/env bash
# The main job: set up from nothing, train a GPT with fsdp2 on 2 CPU ranks, save a checkpoint,
# resume from it (the resumed losses must equal the uninterrupted run's), and consolidate it
# into a Hugging Face style safetensors set.
set -euo pipefail
cd "$(dirname "$0")/.."
. .ci/setup
out=runs/main
rm -rf "$out" && mkdir -p "$out"

echo "== train 40 steps on 2 ranks, checkpoint every 20 =="
python examples/train_gpt.py --nproc 2 --steps 40 --save-every 20 --ckpt "$out/ckpt" --losses-out "$out/full.json"

echo "== resume from step 20 and train to step 40 =="
python examples/train_gpt.py --nproc 2 --steps 40 --ckpt "$out/ckpt/step-20" --resume --losses-out "$out/resumed.json"

python - "$out" <<'PY'
import json, sys
full = json.load(open(f"{sys.argv[1]}/full.json"))
resumed = json.load(open(f"{sys.argv[1]}/resumed.json"))
same = all(full[k] == v for k, v in resumed.items())
print(f"resumed losses {'match' if same else 'DIFFER FROM'} the uninterrupted run for steps {min(map(int, resumed))}-{max(map(int, resumed))}")
sys.exit(0 if same else 1)
PY

echo "== inspect, verify and consolidate the step-40 checkpoint =="
python -m fsdp2.checkpoint inspect "$out/ckpt/step-40" | sed -n 1,12p
python -m fsdp2.checkpoint verify "$out/ckpt/step-40"
python -m fsdp2.checkpoint consolidate "$out/ckpt/step-40" "$out/hf"
python - "$out/hf" <<'PY'
import json, sys
from safetensors.torch import load_file
index = json.load(open(f"{sys.argv[1]}/model.safetensors.index.json"))
tensors = {}
for name in sorted(set(index["weight_map"].values())):
    tensors.update(load_file(f"{sys.argv[1]}/{name}"))
print(f"consolidated: {len(tensors)} full tensors, {sum(t.numel() for t in tensors.values()) / 1e6:.2f}M params, loadable with safetensors.torch.load_file")
PY
