#!/usr/bin/env bash
# Install offload-ref (editable) with its test extra, torch pinned to 2.13.0 (ci/constraints.txt:
# a version, not a build; CI's machines have the CPU build on disk, README "Two commands" says
# how to get it elsewhere).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -c ci/constraints.txt -e ".[test]"
