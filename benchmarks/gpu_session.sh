#!/usr/bin/env bash
# The GPU checks of issues 3 and 4 in one run on a lent GPU machine (about 9 minutes): the CUDA tests,
# the stall per checkpoint against DCP and torch.save, and every-step checkpoints into the memory
# tier, and a training loop saving raw, lossless and lossless with encode_later (host cores idle
# while the GPU trains), and lossless against raw saves bound to 2 and then all 16 host cores
# (issue 4: a lossless save must not be slower than a raw one to local disk). Run from the
# repository root; logs and JSON go to $OUT (or ./bench-out).
# The machine's Python lacks blake3, zstandard and zlib-ng: download their wheels for its Python
# into .whl/ first (pip download --only-binary=:all: --python-version 3.12 ... -d .whl NAME).
set -o pipefail
out=${OUT:-bench-out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD/src
fi
export PYTHONUNBUFFERED=1
python3 setup.py build_ext --inplace >"$out/build.log" 2>&1 || echo "no native build: numpy kernels"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_cuda.py 2>&1 | tee "$out/tests.log" | tail -15
timeout 200 python3 benchmarks/train_overhead.py --device cuda --batch 8192 --steps 30 --every 10 \
    --repeats 3 --dir /tmp --json "$out/train_overhead_cuda.json" 2>&1 | tee "$out/train.log" | tail -12
timeout 120 python3 benchmarks/tiers_restore.py --device cuda --batch 32768 --steps 30 \
    --sections every-step --dir /tmp 2>&1 | tee "$out/every.log" | tail -14
timeout 200 python3 benchmarks/codecs.py --training-loop --device cuda --batch 65536 --steps 20 \
    --repeats 2 --dir /tmp 2>&1 | tee "$out/codec_loop.log" | tail -12
timeout 240 python3 benchmarks/codecs.py --repeated-saves --repeats 5 --cores 2,16 --dir /tmp 2>&1 \
    | tee "$out/codec_cores.log" | grep -E 'Bound|lossless / raw'
