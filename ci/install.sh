#!/usr/bin/env bash
# Install offload-ref (editable) with its test extra, pinned to the CPU build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -c ci/constraints.txt -e ".[test]"
