#!/usr/bin/env bash
# Everything a GPU session measures, in one call: stage fairseq, benchmark fairseq-train per
# precision at two batch sizes with a profile of each mode, the optimizer step, a stock fairseq
# --fp16 checkpoint resumed by the plugin, and the CUDA tests. Sized for a 10-minute device call
# on one H200 (SESSION_BUDGET seconds, default 500: each step's time limit ends by then, and
# modes not started in time are skipped).
#
#   bash scripts/gpu/prepare.sh                             # here, before each device call
#   bash scripts/gpu/session.sh OUT_DIR                     # on the GPU machine (python3 there)
#   bash scripts/gpu/session.sh --smoke OUT_DIR             # tiny sizes on the CPU (.venv)
#
# On the GPU machine it installs .whl/*.whl into /tmp/site, builds fairseq-fixed from
# .whl/fairseq_fixed-*.tar.gz into /tmp/fairseq (scripts/gpu/build_fairseq.py) and uses
# DATA (default data/gpu-bench/bin, built in /tmp if absent). MODES_A / MODES_B override the
# modes at the first / second batch size; MODE_TIMEOUT (SECONDS[,MODE=SECONDS...]) is each
# mode's time limit; SKIP=optimizer,stock,pytest leaves those parts out.
# OUT_DIR gets at most 6 files (a device call returns no more than 8), each written as its
# step ends, each mode's line as the mode ends, so a call cut off keeps what finished:
# session.log (all output, closing with each step's and each mode's outcome),
# train_<tokens>.jsonl per batch size (a header, one line per mode with its profile, a summary;
# scripts/gpu/collect.py turns them into the committed JSON), optimizer.json,
# stock_resume.json, pytest_gpu.txt.
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then  # the comment above
  sed -n "2,$((LINENO - 2))s/^# \{0,1\}//p" "$0"; exit 0
fi
set -uo pipefail
cd "$(dirname "$0")/../.."
smoke=0
if [ "${1:-}" = "--smoke" ]; then smoke=1; shift; fi
out=${1:?usage: session.sh [--smoke] OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
budget=${SESSION_BUDGET:-500}
exec > >(tee -a "$out/session.log") 2>&1
step() { echo "=== [${SECONDS}s] $*"; }
left() { echo $(( budget - SECONDS )); }
skipping() { [[ ",${SKIP:-}," == *",$1,"* ]]; }
status=0
summary=()  # one line per step (and per batch size: each mode's outcome), printed at the end

# limited SECONDS CMD...: CMD killed (its process group) after SECONDS or at the budget's end,
# whichever comes first; 125 without starting it when the budget is spent
limited() {
  local s=$1 l
  shift
  l=$(left)
  (( l < s )) && s=$l
  (( s < 1 )) && return 125
  timeout -k 10 "$s" "$@"
}
# outcome NAME EXIT_CODE [DETAIL]: a line of the closing summary
outcome() {
  local r
  case $2 in
    0) r=ok ;;
    124|137) r="timed out"; status=1 ;;
    125) r="skipped (the session's budget was spent)" ;;
    *) r="failed (exit $2)"; status=1 ;;
  esac
  summary+=("$1: $r${3:+ $3}")
}
finish() {
  step "summary"
  printf '%s\n' "${summary[@]}"
  echo "status $status"
}
trap 'echo "=== cut off"; finish; exit 143' TERM INT HUP

if [ "$smoke" = 1 ]; then
  py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
  export PATH="$(dirname "$py"):$PATH"
  device=(); cpu=(--cpu); opt_device=cpu; params=1e5,1e6; batches=(1024 2048); updates=10; warmup=5
  modes_a=${MODES_A-fp32,fp16}; modes_b=${MODES_B-fp32,bf16}; data=${DATA:-}
  mode_timeout=${MODE_TIMEOUT:-300}
  model="--arch transformer --encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 64 --decoder-embed-dim 64 --encoder-ffn-embed-dim 256 --decoder-ffn-embed-dim 256 --encoder-attention-heads 2 --decoder-attention-heads 2 --share-all-embeddings --dropout 0.1"
  corpus=(--train 2000 --vocab 40 --lengths 20,40)
  staged=ok
else
  py=python3
  export PYTHONPATH="/tmp/fairseq:/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="/tmp/fairseq/bin:$PATH"
  step "staging: wheels into /tmp/site, fairseq-fixed into /tmp/fairseq"
  # CUDA_HOME would make fairseq's own setup compile CUDA extensions; the build here needs none
  limited 300 bash -c '
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl &&
    env -u CUDA_HOME PYTHONPATH=/tmp/site python3 scripts/gpu/build_fairseq.py .whl/fairseq_fixed-*.tar.gz /tmp/fairseq'
  rc=$?
  outcome "staging" $rc
  if [ $rc = 0 ]; then staged=ok; else
    staged="no fairseq"; echo "staging failed: run scripts/gpu/prepare.sh here and carry .whl"
  fi
  # a warm-up of 30: a graphs mode records a CUDA graph on a shape's second batch (16 shapes)
  device=(--cuda); cpu=(); opt_device=cuda; params=1e6,1e7,1e8; batches=(16384 32768); updates=30; warmup=30
  # the precisions, torch.amp (fairseq's --amp: the peer) and the A/B of the fixes at the first
  # size (most wanted first: a mode not started by the deadline is skipped); the fast modes again
  # at the second
  modes_a=${MODES_A-tf32,amp,fp16,fp16-graphs,bf16-graphs,fp16-compiled,fp32,fp16-stock,bf16,fp16-buckets}
  modes_b=${MODES_B-tf32,amp,fp16-graphs,fp16,bf16-graphs,fp16-compiled}
  mode_timeout=${MODE_TIMEOUT:-120,fp16-compiled=240,fp16-graphs=300,bf16-graphs=300}
  data=${DATA:-data/gpu-bench/bin}
  # transformer base (Vaswani et al.): 6+6 layers, d=512, ffn 2048, 8 heads
  model="--arch transformer --share-all-embeddings --dropout 0.1"
  # WMT-like: 20-40 words a sentence, 16k words a side (a joined dictionary of 32k, as BPE)
  corpus=(--train 100000 --vocab 16000 --lengths 20,40)
fi

step "machine"
"$py" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.0f} GiB", p.multi_processor_count, "SMs")
EOF
"$py" -m fairseq_fp16_tools.provenance
[ "$smoke" = 0 ] && nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv

if [ "$staged" = ok ] && { [ -z "$data" ] || [ ! -f "$data/dict.src.txt" ]; }; then
  step "synthetic corpus (${corpus[*]})"
  tmp_corpus=$(mktemp -d)
  if limited 240 "$py" scripts/make_toy_corpus.py "$tmp_corpus" --valid 100 --test 100 "${corpus[@]}" >/dev/null; then
    data=$tmp_corpus/bin
  else
    outcome "corpus" $?; data=""
  fi
fi
ready=ok  # whether fairseq can train here
if [ "$staged" != ok ]; then ready=$staged; elif [ -z "$data" ]; then ready="no corpus"; fi

profiles=$(mktemp -d)
for i in 0 1; do
  tokens=${batches[$i]}
  modes=$([ "$i" = 0 ] && echo "$modes_a" || echo "$modes_b")
  if [ "$ready" != ok ]; then summary+=("train $tokens tokens: skipped ($ready)"); continue; fi
  if [ -z "$modes" ]; then summary+=("train $tokens tokens: skipped (no modes)"); continue; fi
  # modes start until 150 s before the budget's end; the one in flight stops 120 s before it
  step "fairseq-train at $tokens tokens a batch: $modes (deadline in $(( $(left) - 150 ))s)"
  limited $(( $(left) - 120 )) "$py" scripts/bench_fairseq_train.py "$data" "${device[@]}" --modes "$modes" \
      --updates "$updates" --warmup "$warmup" --repeats 1 --model "$model --max-tokens $tokens" \
      --profile-dir "$profiles/$tokens" --mode-timeout "$mode_timeout" --jsonl "$out/train_$tokens.jsonl" \
      --deadline "$(( $(left) - 150 ))"
  rc=$?
  if [ $rc = 125 ]; then outcome "train $tokens tokens" $rc; continue; fi
  [ $rc != 0 ] && status=1
  line="train $tokens tokens: $("$py" scripts/gpu/collect.py --outcomes "$out/train_$tokens.jsonl")"
  [[ $line == *"failed"* || $line == *"timed out"* ]] && status=1
  summary+=("$line$([ $rc != 0 ] && echo " (the benchmark's exit status: $rc)")")
done

step "profiles"
for d in "$profiles"/*/; do
  if ls "$d"*.json >/dev/null 2>&1; then
    echo "-- $(basename "$d") tokens a batch"; "$py" scripts/profile_summary.py "$d"*.json
  fi
done

if skipping optimizer; then summary+=("optimizer: skipped (SKIP)"); else
  step "optimizer step ($params parameters)"
  printed=$(mktemp)
  limited 120 "$py" scripts/bench_optimizer.py --params "$params" --device "$opt_device" > "$printed"
  rc=$?
  cat "$printed"
  [ $rc = 0 ] && tail -n 1 "$printed" > "$out/optimizer.json"
  outcome "optimizer" $rc
fi

if skipping stock; then summary+=("stock checkpoint resume: skipped (SKIP)"); elif [ "$ready" != ok ]; then
  summary+=("stock checkpoint resume: skipped ($ready)")
else
  if [ "$smoke" = 1 ]; then
    step "stock checkpoint resumed by the plugin (CPU: stock fairseq's --fp16 needs CUDA, the stock run is fp32)"
  else
    step "stock fairseq --fp16 checkpoint resumed by the plugin"
  fi
  limited 180 "$py" scripts/gpu/stock_resume.py "$out/stock_resume.json" "$data" "${cpu[@]}"
  outcome "stock checkpoint resume" $? "($([ "$smoke" = 1 ] && echo "stock fp32 on the CPU" || echo "stock --fp16"))"
fi

if [ "$smoke" = 0 ] && ! skipping pytest; then
  if [ "$staged" != ok ]; then summary+=("pytest -m gpu: skipped ($staged)"); else
    step "pytest -m gpu ($(left)s left)"
    limited "$(left)" "$py" -m pytest -q -m gpu -p no:cacheprovider tests > "$out/pytest_gpu.txt" 2>&1
    rc=$?
    tail -n 15 "$out/pytest_gpu.txt"
    outcome "pytest -m gpu" $rc
  fi
fi
finish
exit $status
