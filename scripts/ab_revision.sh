#!/bin/bash
# Same-run A/B(/C...) of the same kernels rendered by several checkouts: each checkout's templates render the
# named time_configs.py kernels, timed alternately, ROUNDS rounds, each verified first; a table of the best
# round per kernel and checkout comes last. Make a checkout of a revision with
# `mkdir .ab-base && git archive HEAD | tar -x -C .ab-base`; compile every checkout's kernels beforehand
# into one cache (the cache is keyed by source, so the checkouts' kernels sit side by side).
# Usage: REVS="base=.ab-base new=." CACHE=.kc-ab ROUNDS=2 bash scripts/ab_revision.sh NAME[@N,..] ...
# (the old form, BASE=.ab-base BASE_CACHE=.kc-base NEW_CACHE=.kc-new, still works).
set -o pipefail
ROUNDS=${ROUNDS:-2}
if [ -z "$REVS" ]; then
  REVS="base=${BASE:-.ab-base}=${BASE_CACHE:-$CACHE} new=.=${NEW_CACHE:-$CACHE}"
fi
log=$(mktemp)
for round in $(seq "$ROUNDS"); do
  for rev in $REVS; do
    IFS== read -r label dir cache <<< "$rev"
    cache=$(realpath -m "${cache:-$CACHE}")
    # an older checkout may predate the script's options
    [ "$(realpath "$dir")" != "$(realpath .)" ] && cp scripts/time_configs.py "$dir/scripts/time_configs.py"
    (cd "$dir" && FLASHGEN_CACHE_DIR=$cache python3 scripts/time_configs.py "$@") | sed "s/^/$label r$round  /" \
      | tee -a "$log"
  done
done
echo
echo "best of $ROUNDS rounds, TFLOP/s (ratio to the first checkout)"
awk -v revs="$REVS" '
  BEGIN { n = split(revs, r, " "); for (i = 1; i <= n; i++) { split(r[i], f, "="); lab[i] = f[1] } }
  / TFLOP\/s/ { key = $3 " " $4; sub(/:$/, "", key); for (i = 1; i <= NF; i++) if ($(i) == "TFLOP/s") tf = $(i - 1)
                if (!(key in seen)) { seen[key] = 1; order[++m] = key }
                if (tf > best[$1, key]) best[$1, key] = tf }
  / VERIFY FAILED/ { key = $3 " " $4; sub(/:$/, "", key); failed[$1, key] = 1; if (!(key in seen)) { seen[key] = 1; order[++m] = key } }
  END { line = sprintf("%-72s", "kernel"); for (i = 1; i <= n; i++) line = line sprintf(" %14s", lab[i]); print line
        for (k = 1; k <= m; k++) { key = order[k]; line = sprintf("%-72s", key); b = best[lab[1], key]
          for (i = 1; i <= n; i++) { v = best[lab[i], key]
            if ((lab[i], key) in failed) cell = "FAILED"
            else if (i == 1 || b == 0) cell = sprintf("%.1f", v)
            else cell = sprintf("%.1f %+.1f%%", v, 100 * (v / b - 1))
            line = line sprintf(" %14s", cell) }
          print line } }' "$log"
rm -f "$log"
