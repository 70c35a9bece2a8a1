#!/usr/bin/env bash
# The README's test command: the whole suite on CPU, two workers.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pytest -n 2 --dist loadgroup "$@"
