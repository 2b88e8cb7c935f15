#!/usr/bin/env bash
# Check this tree on a CUDA machine in under 8 minutes: GPU tests, bench decode on three checkpoints, a serving replay.
#
# Usage: tools/gpu_check.sh [--data DIR] OUTDIR
#
# Steps, in this order, each under its own timeout (a failing or hung step is recorded and the next
# one runs):
#   gpu-tests.log                       pytest -m gpu
#   decode-cuda-qwen3-30b-a3b-8l.json   moeserve bench decode on make-checkpoint's qwen3-30b-a3b shape,
#                                       8 layers (11.2 GB of weights)
#   launches-cuda-qwen3-30b-a3b-8l.json moeserve bench launches (kernel launches, syncs, GPU busy share
#                                       per decoder layer of a decode step) on that shape
#   replay-cuda-qwen3-30b-a3b-8l.txt    moeserve serve on that shape + moeserve replay of the Azure
#                                       conversation trace (summary; the replay's files in replay-cuda-*/)
#   hybrid-cuda-qwen3-30b-a3b-8l-*.json moeserve bench hybrid on that shape: --expert-compute modes at
#                                       batch 1 and 8, and a 2,048-token prefill
#   decode-cuda-mixtral-8x7b-4l.json    bench decode on the mixtral-8x7b shape, 4 layers (12.1 GB)
#   decode-cuda-tiny-moe.json           bench decode on the bundled model (-eager: without CUDA graphs,
#                                       all experts resident)
#   launches-cuda-tiny-moe*.json        bench launches on the bundled model: CUDA graphs on, off
#                                       (-eager), and a 25% buffer (-offloaded)
#   bench-cpu-experts.json              experts computed on this machine's CPU (hybrid execution),
#   bench-kv-cuda.json                  the paged KV cache (-prefix: its live part only, without the
#                                       trace); each where `moeserve bench --help` lists it
# The two real shapes are config-only folders (make-checkpoint --config-only), their weights drawn in
# memory at load (--load-format dummy): no gigabytes written or read. Into OUTDIR go each
# step's output and log (<step>.log), machine.txt (GPU, driver, torch, commit) and summary.txt (each
# step's exit status and seconds; 124 = timed out). The whole run stops starting steps after
# GPU_CHECK_BUDGET_S seconds (default 450); GPU_CHECK_WHEELS names the wheels' folder (default .whl);
# GPU_CHECK_ONLY runs only the steps whose names match its comma-separated globs (a rerun within a
# short lease: GPU_CHECK_ONLY='gpu-tests*,launches-*', or '*qwen3*' with its checkpoint).
#
# Prepare on any machine, from the repository root:
#   * wheels (optional): put them in .whl/ (e.g. `pip download torch --no-deps -d .whl` for the
#     machine's CUDA, `pip wheel --no-deps -w .whl .`); with wheels there, they are installed without
#     the network, and the project from the checkout unless a moeserve wheel is among them; without,
#     the installed torch and moeserve are used. With pytest-xdist's wheels (pytest-xdist, execnet)
#     the GPU tests run in 4 processes.
#   * data: the replay reads arrival_traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv and
#     prompts/prompts_combined.jsonl under --data DIR or $MOESERVE_DATA (default: ../shared/data beside
#     the checkout); the two files may also sit directly in that folder. Without them the replay is skipped.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

usage() { sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
DATA=${MOESERVE_DATA:-}
OUT=
while [ $# -gt 0 ]; do
  case $1 in
    --data) DATA=${2:?--data needs a folder}; shift 2 ;;
    --data=*) DATA=${1#*=}; shift ;;
    -h | --help) usage; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) OUT=$1; shift ;;
  esac
done
[ -n "$OUT" ] || { usage >&2; exit 2; }
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
[ -z "$DATA" ] || DATA=$(cd "$DATA" 2>/dev/null && pwd) || { echo "gpu_check.sh: no folder $DATA" >&2; exit 2; }
cd "$(dirname "$0")/.." || exit 2
DATA=${DATA:-../shared/data}
BUDGET=${GPU_CHECK_BUDGET_S:-450}
CKPT=${TMPDIR:-/tmp}/moeserve-gpu-check
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
declare -A PIDS STARTED

record() {  # record NAME RC T0: one summary line
  local what="rc=$2"
  [ "$2" = 124 ] && what="timed out"
  echo "$1: $what, $(($SECONDS - $3)) s (at $SECONDS s)" | tee -a "$SUMMARY"
}
note() { echo "$1 (at $SECONDS s)" | tee -a "$SUMMARY"; }
wanted() {  # wanted NAME: whether GPU_CHECK_ONLY (comma-separated glob patterns; unset: all) selects it
  [ -z "${GPU_CHECK_ONLY:-}" ] && return 0
  case $1 in install*) return 0 ;; esac
  local pattern patterns
  IFS=, read -ra patterns <<< "$GPU_CHECK_ONLY"
  for pattern in "${patterns[@]}"; do
    # shellcheck disable=SC2053  # a glob, on purpose
    [[ $1 == $pattern ]] && return 0
  done
  return 1
}
step() {  # step NAME TIMEOUT_S CMD...: CMD's stdout into OUT/NAME, its stderr into OUT/<NAME less extension>.log
  local name=$1 limit=$2 left=$((BUDGET - SECONDS)) t0=$SECONDS
  shift 2
  if ! wanted "$name"; then note "$name: not selected by GPU_CHECK_ONLY"; return 1; fi
  if [ "$left" -lt 30 ]; then note "$name: skipped, ${left} s of the budget left"; return 1; fi
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$name" != "${name%.log}" ]; then  # a .log step: its whole output there
    timeout -k 10 "$limit" "$@" > "$OUT/$name" 2>&1
  else
    timeout -k 10 "$limit" "$@" > "$OUT/$name" 2> "$OUT/${name%.*}.log"
  fi
  local rc=$?
  record "$name" "$rc" "$t0"
  return "$rc"
}
background() {  # background NAME TIMEOUT_S CMD...: start CMD now (output into OUT/NAME.log); await NAME
  local name=$1 limit=$2
  shift 2
  wanted "$name" || return 0
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1 &
  PIDS[$name]=$!
  STARTED[$name]=$SECONDS
}
await() {  # await NAME: wait for a background step and record it; its exit status (1: not started)
  [ -n "${PIDS[$1]:-}" ] || return 1
  wait "${PIDS[$1]}"
  local rc=$?
  record "$1" "$rc" "${STARTED[$1]}"
  return "$rc"
}
find_data() {  # find_data RELATIVE: DATA/RELATIVE, or DATA/its file name; empty when neither exists
  if [ -f "$DATA/$1" ]; then echo "$DATA/$1"; elif [ -f "$DATA/${1##*/}" ]; then echo "$DATA/${1##*/}"; fi
}
replay_check() {  # replay_check MODEL NAME: serve MODEL (config only) on the GPU, wait for /health, replay
  local model=$1 name=$2 port=${GPU_CHECK_PORT:-8000}
  python3 -m moeserve serve --model "$model" --load-format dummy --device cuda --dtype bf16 --port "$port" \
    > "$OUT/$name-serve.log" 2>&1 &
  SERVER=$!
  trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
  local waited=0
  until python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
    "http://127.0.0.1:$port/health" > /dev/null 2>&1; do
    kill -0 "$SERVER" 2>/dev/null || { echo "the server exited; see $name-serve.log" >&2; return 1; }
    [ $((waited += 1)) -le 150 ] || { echo "no /health after 150 s" >&2; return 1; }
    sleep 1
  done
  echo "server ready after about $waited s" >&2
  # --rps scales the whole file's mean rate and a window keeps its own bursts and lulls: the 45 s
  # from trace second 180 offer 100 requests, 2.27 req/s (the window from second 60: 1.69 req/s)
  python3 -m moeserve replay --url "http://127.0.0.1:$port" --trace "$TRACE" --prompts "$PROMPTS" \
    --rps 2 --trace-offset 180 --duration 45 --max-tokens-cap 64 --tokenizer "$model" --seed 0 \
    --no-progress --out "$OUT/$name"
}
export -f replay_check
export OUT

# The software: wheels from .whl/ when there are any, then the project unless a wheel brought it.
WHEELS=${GPU_CHECK_WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  step install.log 180 python3 -m pip install --no-index --no-deps --no-compile "$WHEELS"/*.whl
fi
if ! python3 -m pip show -q moeserve > /dev/null 2>&1; then
  step install-project.log 120 python3 -m pip install --no-index --no-deps --no-build-isolation -e .
fi

# The machine.
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi: not found"
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
    'available', torch.cuda.is_available())"
  python3 -m moeserve --version
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(nproc) CPUs, $(date -u +%FT%TZ)"
} 2>&1 | tee "$OUT/machine.txt"

mkdir -p "$CKPT"
TRACE=$(find_data arrival_traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv)
PROMPTS=$(find_data prompts/prompts_combined.jsonl)
export TRACE PROMPTS
background ckpt-qwen3-30b-a3b-8l 60 \
  python3 -m moeserve make-checkpoint --shape qwen3-30b-a3b --layers 8 --out "$CKPT/qwen3-8l" --config-only
background ckpt-mixtral-8x7b-4l 60 \
  python3 -m moeserve make-checkpoint --shape mixtral-8x7b --layers 4 --out "$CKPT/mixtral-4l" --config-only

DECODE=(python3 -m moeserve bench decode --device cuda --dtype bf16 --link-gbps 0 --prefill-len 2048
  --fractions 1.0,0.25 --repeats 3 --json)
# the GPU tests in 4 processes where pytest-xdist is installed (one GPU holds them all; most of a
# test's time is compiling its kernels on the CPU), else in one
XDIST=()
python3 -c "import xdist" > /dev/null 2>&1 && XDIST=(-n 4)
# In order of what a short lease must not miss (the budget skips the last): the GPU tests, the
# qwen3-30b-a3b shape (decode, launches, serving), its hybrid rows, Mixtral, the bundled model.
step gpu-tests.log 180 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --continue-on-collection-errors \
  "${XDIST[@]}" tests
if await ckpt-qwen3-30b-a3b-8l; then
  step decode-cuda-qwen3-30b-a3b-8l.json 120 "${DECODE[@]}" --model "$CKPT/qwen3-8l" --load-format dummy
  step launches-cuda-qwen3-30b-a3b-8l.json 60 python3 -m moeserve bench launches --device cuda --json \
    --model "$CKPT/qwen3-8l" --load-format dummy
  if [ -n "$TRACE" ] && [ -n "$PROMPTS" ]; then
    # up to 150 s for serve to load and capture its decode graphs, 45 s of arrivals, then the tail
    step replay-cuda-qwen3-30b-a3b-8l.txt 210 \
      bash -c 'replay_check "$@"' _ "$CKPT/qwen3-8l" replay-cuda-qwen3-30b-a3b-8l
  else
    note "replay-cuda-qwen3-30b-a3b-8l.txt: skipped, no trace or prompts under $DATA"
  fi
else
  note "decode-cuda-qwen3-30b-a3b-8l.json, replay: skipped, no checkpoint"
fi

# Hybrid expert execution on the qwen3-30b-a3b shape over the real link, 25% buffer: decode TPOT by
# mode beside the hybrid bound at batch 1 and 8, then a 2,048-token prefill with auto and device.
if [ -d "$CKPT/qwen3-8l" ] && grep -qE '^ +hybrid\b' <<< "$(python3 -m moeserve bench --help 2>/dev/null)"; then
  HYBRID=(python3 -m moeserve bench hybrid --model "$CKPT/qwen3-8l" --load-format dummy --device cuda --dtype bf16
    --link-gbps 0 --buffer-fraction 0.25 --repeats 3 --json)
  step hybrid-cuda-qwen3-30b-a3b-8l-b1.json 90 "${HYBRID[@]}" --modes device,cpu,auto --batch 1
  step hybrid-cuda-qwen3-30b-a3b-8l-prefill.json 90 "${HYBRID[@]}" --modes device,auto --new-tokens 4 \
    --prefill-len 2048
  step hybrid-cuda-qwen3-30b-a3b-8l-b8.json 90 "${HYBRID[@]}" --modes device,cpu,auto --batch 8
fi

# The Mixtral shape (its HBM bound), then the bundled model: decode with and without CUDA graphs,
# launches with graphs, without, and with a 25% buffer.
if await ckpt-mixtral-8x7b-4l; then
  step decode-cuda-mixtral-8x7b-4l.json 120 "${DECODE[@]}" --model "$CKPT/mixtral-4l" --load-format dummy
else
  note "decode-cuda-mixtral-8x7b-4l.json: skipped, no checkpoint"
fi
step decode-cuda-tiny-moe.json 120 "${DECODE[@]}"
step launches-cuda-tiny-moe.json 45 python3 -m moeserve bench launches --device cuda --json
step launches-cuda-tiny-moe-eager.json 45 python3 -m moeserve bench launches --device cuda --json --enforce-eager
step launches-cuda-tiny-moe-offloaded.json 45 python3 -m moeserve bench launches --device cuda --json \
  --buffer-fraction 0.25
step decode-cuda-tiny-moe-eager.json 60 python3 -m moeserve bench decode --device cuda --dtype bf16 \
  --link-gbps 0 --prefill-len 0 --fractions 1.0 --repeats 3 --no-transformers --enforce-eager --json

# Hybrid CPU experts and the paged KV cache: their rows run where this tree has the benches.
BENCHES=$(python3 -m moeserve bench --help 2>/dev/null)
if grep -qE '^ +cpu-experts\b' <<< "$BENCHES"; then
  step bench-cpu-experts.json 90 \
    python3 -m moeserve bench cpu-experts --shapes qwen3-30b-a3b,mixtral-8x7b --formats bf16 --json
fi
if grep -qE '^ +kv\b' <<< "$BENCHES"; then
  # the scheduler replay of the trace's lengths, then the prefix cache on a live CUDA server
  if [ -n "$TRACE" ]; then
    step bench-kv-cuda.json 90 python3 -m moeserve bench kv --device cuda --trace "$TRACE" --json
  else
    step bench-kv-prefix-cuda.json 90 python3 -m moeserve bench kv --prefix-chat --device cuda --json
  fi
fi

rm -rf "$CKPT"
note "done"
