#!/usr/bin/env bash
# The GPU path's first run (issue 21): one line per check, at most 10 minutes in all.
# On a machine with a CUDA GPU, from the repository root:  bash bench/gpu_smoke.sh
# It uses the project's venv when there is one (make install), else the python3 on PATH, and
# installs nothing it cannot: torch with CUDA must be there already (a machine without the
# network cannot fetch it). Without a GPU it prints one SKIP line; bench/gpu_smoke.py --device
# cpu runs the same checks on the CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
if ! "$PY" -c "import tokenflow" 2>/dev/null; then
    "$PY" -m pip install -q --no-deps -e . 2>/dev/null || echo "NOTE  tokenflow not installed: running from the checkout"
fi
for module in transformers ray; do
    "$PY" -c "import $module" 2>/dev/null || "$PY" -m pip install -q "$module" 2>/dev/null \
        || echo "NOTE  $module missing and not installable here"
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 600 "$PY" bench/gpu_smoke.py --budget-s 570 "$@"
