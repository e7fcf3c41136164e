#!/usr/bin/env bash
# The GPU checks of a session, in one call on a machine with one CUDA GPU (docs/gpu.md):
#   1. pytest tests/gpu        -> $OUT/gpu_tests.log
#   2. scripts/advise_accuracy_gpu.py (issue 55's GPU check) -> $OUT/advise_gpu.log, advise_gpu.json
#   3. scripts/bench_cuda.py   -> $OUT/bench_cuda.log, bench_cuda.json
# Each step has its own timeout; every log goes to $OUT (default /tmp/gpu_checks). Run from the repository
# root, with python3 holding torch, tensorboard and lightning. Packages that python3 lacks travel in .whl/
# (ignored by git): megatron-core's wheel(s) in .whl/*.whl, pure-Python packages (omegaconf, for
# scripts/demo.py) as folders in .whl/pure/. They go to /tmp/site, which a .pth file puts on python3's
# path: the launches under torchrun get PYTHONPATH set to the repository alone (nemo_memlog/testing/torchrun.py).
#
#   bash scripts/gpu_checks.sh [PYTEST_TIMEOUT_S=270] [ADVISE_TIMEOUT_S=120] [BENCH_TIMEOUT_S=80]
# On an H200 tests/gpu took more than 270 s (docs/gpu.md: 5 to 8 minutes; test_megatron_lm_gpu.py alone 172 s),
# the script about 95 s, the bench 22 s: within a 10-minute call, give pytest 450 or run it apart.
set -u
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
if [ -d .whl/pure ]; then mkdir -p /tmp/site && cp -r .whl/pure/. /tmp/site/; fi
if [ -d /tmp/site ]; then
    echo /tmp/site >"$(python3 -c 'import site; print(site.getsitepackages()[0])')/zz_gpu_checks_site.pth" || exit 1
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
set -o pipefail
{
    date -u
    nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, megatron.core, omegaconf, lightning, tensorboard; print('python', __import__('sys').version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'megatron-core', megatron.core.__version__, 'lightning', lightning.__version__, 'tensorboard', tensorboard.__version__)"
} 2>&1 | tee "$OUT/env.log"
start=$(date +%s)
timeout "${1:-270}" python3 -m pytest -q -p no:cacheprovider -p no:randomly -rfEs --durations=12 tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -45
echo "pytest: rc $? in $(($(date +%s) - start)) s" | tee -a "$OUT/gpu_tests.log"
start=$(date +%s)
timeout "${2:-120}" python3 scripts/advise_accuracy_gpu.py --json "$OUT/advise_gpu.json" 2>&1 | tee "$OUT/advise_gpu.log"
echo "advise_accuracy_gpu: rc $? in $(($(date +%s) - start)) s" | tee -a "$OUT/advise_gpu.log"
start=$(date +%s)
timeout "${3:-80}" python3 scripts/bench_cuda.py --reps 3000 --json "$OUT/bench_cuda.json" 2>&1 | tee "$OUT/bench_cuda.log"
echo "bench_cuda: rc $? in $(($(date +%s) - start)) s" | tee -a "$OUT/bench_cuda.log"
