#!/usr/bin/env bash
# The checks that need a GPU, in one go (about 10 minutes on an H100 or H200): the machine's facts,
# benchmarks/bench_gpu_lightning.py (a Hugging Face GPT-2 under Lightning, checkpointed every 10 steps
# through the memory level), tests/test_gpu.py (its CUDA tests run only here), then
# benchmarks/bench_gpu.py at 1, 4 and 16 GiB.
# It uses the machine's own python3 and its CUDA build of torch (not the CPU virtual environment of
# scripts/setup_env.sh); the package is taken from this checkout (PYTHONPATH), nothing is installed.
#
#   bash scripts/gpu_check.sh OUT_DIR            # logs, bench_gpu*.json and bench_gpu*.md land in OUT_DIR
#   SIZES="1" BUDGET=60 LIGHTNING_BUDGET=120 bash scripts/gpu_check.sh OUT_DIR   # a shorter run
set -uo pipefail
out=${1:?usage: bash scripts/gpu_check.sh OUT_DIR}
cd "$(dirname "$0")/.."
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
    "$py" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
    echo "cpus $(nproc)"; free -g | head -2; df -h "$PWD" /tmp /var/tmp /dev/shm
} 2>&1 | tee "$out/env.txt"
rc=0
timeout "${LIGHTNING_TIMEOUT:-300}" "$py" benchmarks/bench_gpu_lightning.py --budget-s "${LIGHTNING_BUDGET:-150}" \
    --out "$out" 2>&1 | tee "$out/bench_gpu_lightning.log" || rc=1
timeout "${TEST_TIMEOUT:-240}" "$py" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py 2>&1 \
    | tee "$out/test_gpu.log" || rc=1
# shellcheck disable=SC2086  # SIZES is a list
timeout "${BENCH_TIMEOUT:-400}" "$py" benchmarks/bench_gpu.py --sizes-gib ${SIZES:-1 4 16} \
    --budget-s "${BUDGET:-280}" --out "$out" 2>&1 | tee "$out/bench_gpu.log" || rc=1
exit $rc
