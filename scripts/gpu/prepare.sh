#!/usr/bin/env bash
# What a GPU session needs from this machine, before each device call (package access the first
# time):
#
#   bash scripts/gpu/prepare.sh
#
# 1. .whl/: wheels and fairseq-fixed's sdist (scripts/gpu/stage_wheels.sh; files there are kept);
# 2. data/gpu-bench/bin: the benchmark corpus, transformer-base sized (built once);
# 3. .whl/source.json: the commit and the content hashes of the source, so that the GPU
#    machine, which gets the tree without .git, records which commit it measured
#    (fairseq_fp16_tools/provenance.py; a file changed after this step shows as a change);
# 4. the sizes of what travels: the working tree (tracked and unignored files) with the carried
#    .whl and data/gpu-bench/bin must stay under the device call's 64 MiB. Exits 1 above it.
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then  # the comment above
  sed -n "2,$((LINENO - 2))s/^# \{0,1\}//p" "$0"; exit 0
fi
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
data=data/gpu-bench

if ! ls .whl/fairseq_fixed-*.tar.gz >/dev/null 2>&1; then
  bash scripts/gpu/stage_wheels.sh .whl
fi
if [ ! -f "$data/bin/dict.src.txt" ]; then
  # WMT-like: 20-40 words a sentence, 16k words a side (a joined dictionary of 32k, as BPE)
  "$py" scripts/make_toy_corpus.py "$data" --valid 100 --test 100 --train 100000 --vocab 16000 \
      --lengths 20,40 >/dev/null
fi
"$py" -m fairseq_fp16_tools.provenance --stage .whl/source.json

tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null \
       | awk '{s += $1} END {print s + 0}')
whl=$(du -sb .whl | cut -f1)
bin=$(du -sb "$data/bin" | cut -f1)
total=$(( tree + whl + bin ))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
echo "travels: working tree $(mib "$tree"), .whl $(mib "$whl"), $data/bin $(mib "$bin"): $(mib "$total") of 64 MiB"
if [ "$total" -gt $(( 64 * 1048576 )) ]; then
  echo "over the device call's 64 MiB: carry less" >&2
  exit 1
fi
