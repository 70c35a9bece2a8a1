#!/usr/bin/env bash
# Wheels the GPU machine lacks, for ci/gpu_session.sh: its image (Python 3.12) has torch,
# accelerate, transformers, huggingface-hub and safetensors but not diffusers, and reaches no
# package index.  Run here, in the repository's root, before the device call; then name `.whl`
# in the call's `carry` (about 6.4 MB).  Versions: diffusers as ci/constraints.txt pins it.
set -euo pipefail
cd "$(dirname "$0")/.."
diffusers=$(grep -E '^diffusers==' ci/constraints.txt)
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 -d .whl "$diffusers" importlib_metadata
ls .whl
