#!/usr/bin/env bash
# Prepare, on a machine with package access, what the GPU machine's image lacks to run this
# project: wheels for its Python (3.12, x86-64) and fairseq-fixed's source distribution. The
# GPU machine has its own CUDA torch, numpy, sacrebleu, scipy, cython and a compiler, and no
# network; scripts/gpu/session.sh installs these files there and builds fairseq's extensions.
#
#   bash scripts/gpu/stage_wheels.sh [DIR]     # default DIR: .whl (ignored by git; carry it)
#
# scripts/gpu/prepare.sh runs it, and writes .whl/source.json beside the wheels.
#
# The list below is fairseq-fixed's requirements minus what that image holds (the device
# tool's package list). Idempotent: files already in DIR are kept.
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then  # the comment above
  sed -n "2,$((LINENO - 2))s/^# \{0,1\}//p" "$0"; exit 0
fi
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:-.whl}
mkdir -p "$dir"
# fairseq-fixed's setup.py imports torch even to be downloaded: the project's .venv has it
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
FAIRSEQ=fairseq-fixed==0.12.3.1
# name==version: fairseq-fixed's pins (hydra-core, omegaconf) and what they need; this
# project's sentence-splitter (the test suite imports it)
WHEELS=(hydra-core==1.3.2 omegaconf==2.3.0 bitarray==3.7.1 cffi==1.17.1 pycparser==2.22
        sentence-splitter==1.4)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
           manylinux1_x86_64)
pip_dl=("$py" -m pip download -q --no-deps -d "$dir")

"${pip_dl[@]}" --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" "${WHEELS[@]}"
# antlr4-python3-runtime 4.9.3 (omegaconf's pin) is published as source only: pure Python,
# so a wheel built here installs anywhere.
if ! ls "$dir"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1; then
  "$py" -m pip wheel -q --no-deps -w "$dir" antlr4-python3-runtime==4.9.3
fi
"${pip_dl[@]}" --no-binary=:all: --no-build-isolation "$FAIRSEQ"
ls -1 "$dir"
du -sh "$dir"
