#!/usr/bin/env bash
# Runs the DDP tests N times in a row (default 30) and stops at the first failure: a check for
# teardown races that a single CI run can miss. Usage: MULTI30K_DIR=... scripts/ddp_loop.sh [N]
set -u
N=${1:-30}
cd "$(dirname "$0")/.."
for i in $(seq "$N"); do
  if .venv/bin/python -m pytest -q tests/training/test_ddp.py > /tmp/ddp_loop_last.log 2>&1; then
    echo "run $i/$N: $(tail -n 1 /tmp/ddp_loop_last.log)"
  else
    echo "run $i/$N FAILED:"; tail -n 40 /tmp/ddp_loop_last.log; exit 1
  fi
done
echo "all $N runs passed"
