#!/usr/bin/env bash
# The GPU session routine (docs/benchmarks.md): run on a lent GPU machine through the device tool,
# from the repository root, with carry [".whl", ".gpu"] (the wheels of ../shared/tools/gpu-wheels.sh;
# the Azure conv trace and prompts_combined.jsonl copied into .gpu/). Writes under $OUT:
#   log.txt (machine, checkpoint times, each step's exit status), gpu-tests.log,
#   decode-cuda-{tiny-moe,qwen3-30b-a3b-8l,mixtral-8x7b-4l}.json (moeserve bench decode --json),
#   replay-cuda-qwen3-30b-a3b-8l-{1.0,0.25}.txt (moeserve replay's summary; 0.25 only if time is left).
# About 500 s on an H100: the two checkpoints (23 GB) are written in the background meanwhile.
export PYTHONUNBUFFERED=1
: "${OUT:?run through the device tool, which sets OUT}"
{
  python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl &&
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} > "$OUT/log.txt" 2>&1 || exit 1
mkdir -p /tmp/ckpt
python3 -m moeserve make-checkpoint --shape qwen3-30b-a3b --layers 8 --out /tmp/ckpt/qwen3-8l > /tmp/mkq.log 2>&1 &
MQ=$!
python3 -m moeserve make-checkpoint --shape mixtral-8x7b --layers 4 --out /tmp/ckpt/mixtral-4l > /tmp/mkm.log 2>&1 &
MM=$!

note() { echo "$1 at $SECONDS s" >> "$OUT/log.txt"; }
bench() {  # $1 = output name, then bench decode's arguments
  local name=$1
  shift
  timeout 150 python3 -m moeserve bench decode --device cuda --dtype bf16 --link-gbps 0 --prefill-len 2048 \
    --json "$@" > "$OUT/decode-cuda-$name.json" 2>> "$OUT/log.txt"
  note "bench $name rc=$?"
}
replay() {  # $1 = buffer fraction
  python3 -m moeserve serve --model /tmp/ckpt/qwen3-8l --device cuda --dtype bf16 --buffer-fraction "$1" \
    --port 8000 >> "$OUT/log.txt" 2>&1 &
  local server=$!
  for _ in $(seq 120); do curl -sf localhost:8000/v1/models > /dev/null && break; sleep 1; done
  timeout 100 python3 -m moeserve replay --url http://127.0.0.1:8000 --trace .gpu/AzureLLMInferenceTrace_conv.csv \
    --prompts .gpu/prompts_combined.jsonl --rps 2 --trace-offset 60 --duration 60 --max-tokens-cap 64 \
    --tokenizer /tmp/ckpt/qwen3-8l --seed 0 --no-progress --out "/tmp/replay-$1" \
    > "$OUT/replay-cuda-qwen3-30b-a3b-8l-$1.txt" 2>&1
  note "replay $1 rc=$?"
  kill "$server"
  wait "$server"
}

timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_devices.py tests/test_sampler_processors.py \
  tests/test_experts.py tests/test_attention.py tests/test_engine_sampling.py > "$OUT/gpu-tests.log" 2>&1
note "tests rc=$?"
bench tiny-moe
wait $MQ
tail -1 /tmp/mkq.log >> "$OUT/log.txt"
bench qwen3-30b-a3b-8l --model /tmp/ckpt/qwen3-8l --fractions 1.0,0.25
if [ $SECONDS -lt 400 ]; then replay 1.0; else note "no time for replay 1.0"; fi
wait $MM
tail -1 /tmp/mkm.log >> "$OUT/log.txt"
bench mixtral-8x7b-4l --model /tmp/ckpt/mixtral-4l --fractions 1.0,0.25
if [ $SECONDS -lt 370 ]; then replay 0.25; else note "no time for replay 0.25"; fi
note done
