#!/usr/bin/env bash
# The GPU checks, in one run on a CUDA machine (docs/benchmarks.md "GPU"): the cuda-marked tests,
# every fixture x strategy through the accelerator platform, and the bench on the device (with
# the peers: run ci/gpu_wheels.sh here first and carry .whl).
# Writes its logs to ${OUT:-/tmp/offload_ref_gpu}.  The simulated accelerator is not loaded
# (OFFLOAD_REF_SIM=0): the device is the real one.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/offload_ref_gpu}
mkdir -p "$out"
export OFFLOAD_REF_SIM=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.txt" 2>&1 \
  || { cat "$out/install.txt"; exit 1; }
# diffusers for the peers (ci/gpu_wheels.sh fetched it into .whl, carried with the tree)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >>"$out/install.txt" 2>&1 && export PYTHONPATH=/tmp/site
fi
python3 -c "import diffusers, accelerate; print('peers: diffusers', diffusers.__version__, \
'accelerate', accelerate.__version__)" 2>&1 | tail -1 | tee "$out/peers_versions.txt"
{ nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"; } \
  2>&1 | tee "$out/machine.txt"
timeout 180 python3 -m pytest -p no:cacheprovider -q -m cuda -n 0 --offload-ref-require-cuda \
  tests/test_platform_cuda.py 2>&1 | tail -25 | tee "$out/cuda_tests.txt"
timeout 150 python3 ci/cuda_fixtures.py --device cuda:0 --repeats 5 2>&1 | tee "$out/cuda_fixtures.txt"
timeout 240 python3 -m pytest -p no:cacheprovider -q -m cuda --benchmark-only -n 0 \
  --offload-ref-require-cuda tests/benchmarks --benchmark-json "$out/cuda_bench.json" 2>&1 \
  | tail -30 | tee "$out/cuda_bench.txt"
# every offloader copying to the GPU, bytes counted (docs/benchmarks.md "Side by side")
timeout 120 python3 -m offload_ref.cli bench --peers --device cuda:0 2>&1 | tee "$out/peers.txt"
timeout 120 python3 -m offload_ref.cli bench --device cuda --hidden 2048 --blocks 8 --tokens 2048 \
  --steps 4 --repeats 5 2>&1 | tee "$out/bench_2048.txt"
# the modeled timeline beside the device: the rows recorded on the simulated accelerator (a
# process with no GPU visible) and replayed on h100-pcie and on a model calibrated here, each
# row's DiT step measured on the GPU (docs/benchmarks.md "Modeled timeline")
timeout 150 python3 -m offload_ref.cli bench --model h100-pcie --calibrate --device cuda:0 \
  2>&1 | tee "$out/model_vs_measured.txt"
