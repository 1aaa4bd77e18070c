#!/usr/bin/env bash
# Everything a GPU session measures, in one call: stage fairseq, benchmark fairseq-train per
# precision at two batch sizes with a profile of each run, the optimizer step, and the CUDA
# tests. Sized to finish inside a 10-minute device call on one H200 (SESSION_BUDGET seconds,
# default 500: modes not yet started by then are skipped and listed in the JSON).
#
#   bash scripts/gpu/stage_wheels.sh                        # here, once (needs package access)
#   bash scripts/gpu/session.sh OUT_DIR                     # on the GPU machine (python3 there)
#   bash scripts/gpu/session.sh --smoke OUT_DIR             # tiny sizes on the CPU (.venv)
#
# On the GPU machine it installs .whl/*.whl into /tmp/site, builds fairseq-fixed from
# .whl/fairseq_fixed-*.tar.gz into /tmp/fairseq (scripts/gpu/build_fairseq.py) and uses
# DATA (default data/gpu-bench/bin, built with scripts/make_toy_corpus.py if absent).
# MODES_A / MODES_B override the modes at the first / second batch size; SKIP=optimizer,pytest
# leaves those parts out.
# OUT_DIR gets at most 8 files (a device call returns no more): session.log (all output and
# the tables), train_<tokens>.json per batch size, profiles.json, optimizer.json,
# pytest_gpu.txt.
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
status=0

if [ "$smoke" = 1 ]; then
  py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
  export PATH="$(dirname "$py"):$PATH"
  device=(); opt_device=cpu; params=1e5,1e6; batches=(1024 2048); updates=10
  modes_a=fp32,fp16; modes_b=fp32,bf16; data=${DATA:-}
  model="--arch transformer --encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 64 --decoder-embed-dim 64 --encoder-ffn-embed-dim 256 --decoder-ffn-embed-dim 256 --encoder-attention-heads 2 --decoder-attention-heads 2 --share-all-embeddings --dropout 0.1"
  corpus=(--train 2000 --vocab 40 --lengths 20,40)
else
  py=python3
  step "staging: wheels into /tmp/site, fairseq-fixed into /tmp/fairseq"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || { echo "staging failed: run scripts/gpu/stage_wheels.sh here and carry .whl"; exit 3; }
  # CUDA_HOME would make fairseq's own setup compile CUDA extensions; the build here needs none
  env -u CUDA_HOME PYTHONPATH=/tmp/site "$py" scripts/gpu/build_fairseq.py .whl/fairseq_fixed-*.tar.gz /tmp/fairseq \
      || { echo "fairseq build failed"; exit 3; }
  export PYTHONPATH="/tmp/fairseq:/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="/tmp/fairseq/bin:$PATH"
  device=(--cuda); opt_device=cuda; params=1e6,1e7,1e8; batches=(16384 32768); updates=30
  # the precisions and the A/B of the fixes at the first size (most wanted first: a mode not
  # started by the deadline is skipped); the fast modes again at the second
  modes_a=${MODES_A:-tf32,fp16,fp16-compiled,bf16,fp32,fp16-stock,fp16-loss-compiled,fp16-cache}
  modes_b=${MODES_B:-tf32,fp16-compiled,fp16,bf16}
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
[ "$smoke" = 0 ] && nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv

if [ -z "$data" ] || [ ! -f "$data/dict.src.txt" ]; then
  step "synthetic corpus (${corpus[*]})"
  tmp_corpus=$(mktemp -d)
  "$py" scripts/make_toy_corpus.py "$tmp_corpus" --valid 100 --test 100 "${corpus[@]}" >/dev/null || exit 3
  data=$tmp_corpus/bin
fi

profiles=$(mktemp -d)
for i in 0 1; do
  tokens=${batches[$i]}
  modes=$([ "$i" = 0 ] && echo "$modes_a" || echo "$modes_b")
  step "fairseq-train at $tokens tokens a batch: $modes (deadline in $(left)s)"
  "$py" scripts/bench_fairseq_train.py "$data" "${device[@]}" --modes "$modes" --updates "$updates" \
      --repeats 1 --model "$model --max-tokens $tokens" --profile-dir "$profiles/$tokens" \
      --deadline "$(( $(left) - 60 ))" > "$out/train_$tokens.txt" || status=1
  cat "$out/train_$tokens.txt"
  tail -n 1 "$out/train_$tokens.txt" > "$out/train_$tokens.json"
  rm -f "$out/train_$tokens.txt"
done

step "profiles"
"$py" - "$profiles" "$out/profiles.json" <<'EOF'
import json, sys
from pathlib import Path
root = Path(sys.argv[1])
merged = {d.name: {p.stem: json.loads(p.read_text()) for p in sorted(d.glob("*.json"))}
          for d in sorted(root.iterdir()) if d.is_dir()}
Path(sys.argv[2]).write_text(json.dumps(merged))
EOF
for d in "$profiles"/*/; do
  echo "-- $(basename "$d") tokens a batch"; "$py" scripts/profile_summary.py "$d"*.json
done

if [[ ",${SKIP:-}," != *,optimizer,* ]]; then
step "optimizer step ($params parameters)"
"$py" scripts/bench_optimizer.py --params "$params" --device "$opt_device" | tee "$out/optimizer.txt" || status=1
tail -n 1 "$out/optimizer.txt" > "$out/optimizer.json" && rm -f "$out/optimizer.txt"
fi

if [ "$smoke" = 0 ] && [[ ",${SKIP:-}," != *,pytest,* ]]; then
  step "pytest -m gpu ($(left)s left)"
  timeout "$(( $(left) > 30 ? $(left) : 30 ))" "$py" -m pytest -q -m gpu -p no:cacheprovider tests \
      > "$out/pytest_gpu.txt" 2>&1 || status=1
  tail -n 15 "$out/pytest_gpu.txt"
fi
step "done (status $status)"
exit $status
