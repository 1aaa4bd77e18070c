#!/usr/bin/env bash
# The prepared benchmark run: optimizer step vs memory bandwidth, and fairseq-train throughput and
# peak memory per precision (fp32, TF32, fp16 with the plugin, stock fairseq --fp16, bf16 with the
# plugin) on synthetic data. On one H200 it is sized to finish in under 8 minutes.
#
#   bash scripts/bench_gpu.sh [OUT_DIR]            # on a CUDA machine (default OUT_DIR benchmarks/gpu)
#   bash scripts/bench_gpu.sh --smoke [OUT_DIR]    # tiny sizes on the CPU (default benchmarks/cpu-smoke)
#
# Writes OUT_DIR/optimizer.json and OUT_DIR/fairseq_train.json (the scripts' last lines) and the
# printed tables beside them. PYTHON selects the interpreter (default: .venv/bin/python or python3);
# LENGTHS=MIN,MAX the synthetic sentences' words (default 3,12; LENGTHS=20,40 for WMT-like ones).
set -euo pipefail
cd "$(dirname "$0")/.."
smoke=0
if [ "${1:-}" = "--smoke" ]; then smoke=1; shift; fi
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PATH="$(dirname "$py"):$PATH"
data_dir=$(mktemp -d)
trap 'rm -rf "$data_dir"' EXIT

if [ "$smoke" = 1 ]; then
  out=${1:-benchmarks/cpu-smoke}
  params=1e6,1e7; device=cpu; train_flags=(); modes=fp32,fp16,bf16; updates=15; train_pairs=2000; vocab=40
  model="--arch transformer --encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 64 --decoder-embed-dim 64 --encoder-ffn-embed-dim 256 --decoder-ffn-embed-dim 256 --encoder-attention-heads 2 --decoder-attention-heads 2 --share-all-embeddings --max-tokens 1024"
else
  out=${1:-benchmarks/gpu}
  params=1e6,1e7,1e8; device=cuda; train_flags=(--cuda); modes=fp32,tf32,fp16,fp16-unfused,fp16-stock,bf16; updates=60; train_pairs=200000
  vocab=16000  # words a side: a joined dictionary of 32k, as WMT en-de's BPE (logits and loss at scale)
  # transformer-base shape (Vaswani et al.): 6+6 layers, d=512, ffn 2048, 8 heads
  model="--arch transformer --share-all-embeddings --max-tokens 8192 --dropout 0.1"
fi
mkdir -p "$out"
echo "=== $(date -u +%FT%TZ) device=$device python=$py torch=$($py -c 'import torch; print(torch.__version__)')"
[ "$device" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

echo "=== optimizer step (params $params)"
$py scripts/bench_optimizer.py --params "$params" --device "$device" | tee "$out/optimizer.txt"
tail -n 1 "$out/optimizer.txt" > "$out/optimizer.json"

lengths=${LENGTHS:-3,12}
echo "=== synthetic corpus ($train_pairs pairs, $vocab words a side, $lengths words a sentence)"
$py scripts/make_toy_corpus.py "$data_dir" --train "$train_pairs" --valid 100 --test 100 --vocab "$vocab" \
    --lengths "$lengths" >/dev/null

echo "=== fairseq-train ($modes, $updates updates each)"
$py scripts/bench_fairseq_train.py "$data_dir/bin" "${train_flags[@]}" --modes "$modes" \
    --updates "$updates" --repeats 1 --model "$model" | tee "$out/fairseq_train.txt"
tail -n 1 "$out/fairseq_train.txt" > "$out/fairseq_train.json"
echo "=== done: $out"
