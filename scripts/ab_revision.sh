#!/bin/bash
# Same-run A/B of kernels rendered by a base checkout (e.g. the last commit: git archive HEAD | tar -x -C .ab-base)
# against the working tree's: the same time_configs.py names timed by both, alternating, ROUNDS rounds, each
# verified first. Compile both sides' kernels beforehand and point BASE_CACHE / NEW_CACHE at them.
# Usage: BASE=.ab-base BASE_CACHE=.kc-base NEW_CACHE=.kc-new ROUNDS=2 bash scripts/ab_revision.sh NAME[@N,..] ...
set -o pipefail
BASE=${BASE:-.ab-base}; ROUNDS=${ROUNDS:-2}
cp scripts/time_configs.py "$BASE/scripts/time_configs.py"  # the base may predate the script's options
for round in $(seq "$ROUNDS"); do
  (cd "$BASE" && FLASHGEN_CACHE_DIR=$(realpath -m "../$BASE_CACHE") python3 scripts/time_configs.py "$@") | sed "s/^/base r$round  /"
  FLASHGEN_CACHE_DIR=$NEW_CACHE python3 scripts/time_configs.py "$@" | sed "s/^/new  r$round  /"
done
