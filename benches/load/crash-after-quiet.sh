#!/usr/bin/env bash
# A crash in a quiet spell, and the restart after it, with `anima-load` making the busy spell.
#
#   KEEP=/tmp/k REAL_ENGINE=target/release/anima-wake QUIET_SECONDS=40 \
#     target/release/anima-load --duration-seconds 45 --state-at-every-seconds 0 \
#     --binary benches/load/crash-after-quiet.sh
#   (wait QUIET_SECONDS + a few: the file $KEEP/killed_at appears)
#   benches/load/crash-after-quiet.sh restart target/release/anima-wake /tmp/k
#
# As `--binary`: runs REAL_ENGINE with its data dir moved to $KEEP/data (kept after the run),
# its config copied to $KEEP/anima.toml and its log in $KEEP/engine.stderr. On the tool's SIGTERM
# it exits at once, leaves the engine running with no traffic for QUIET_SECONDS, lists the
# checkpoint store's journal into $KEEP/journal_at_kill, and kills the engine with SIGKILL.
# `restart BIN DIR`: starts BIN on DIR's data dir and prints the seconds from the spawn to its
# gRPC listener, with the log line of the checkpoint store's open (the journal it read), then
# stops it with SIGTERM.
set -euo pipefail

if [ "${1:-}" = restart ]; then
  bin=$2 keep=$3
  out=$(mktemp) err=$(mktemp)
  started=$(date +%s.%N)
  ANIMA_LOG=info "$bin" serve --config "$keep/anima.toml" --data "$keep/data" \
    --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 > "$out" 2> "$err" &
  engine=$!
  until grep -q '^anima-wake listening on' "$out"; do
    kill -0 "$engine" 2> /dev/null || { cat "$err" >&2; exit 1; }
    sleep 0.005
  done
  serving=$(date +%s.%N)
  grep 'checkpoint store opened' "$err" || true
  echo "serving $(awk "BEGIN { printf \"%.3f\", $serving - $started }") s after the spawn"
  kill -TERM "$engine"
  wait "$engine" || true
  rm -f "$out" "$err"
  exit 0
fi

: "${KEEP:?}" "${REAL_ENGINE:?}"
quiet=${QUIET_SECONDS:-40}
args=("$@")
for i in "${!args[@]}"; do
  case "${args[$i]}" in
    --data) args[i + 1]=$KEEP/data ;;
    --config) cp "${args[i + 1]}" "$KEEP/anima.toml" ;;
  esac
done
"$REAL_ENGINE" "${args[@]}" 2>> "$KEEP/engine.stderr" &
engine=$!
crash() {
  (
    sleep "$quiet"
    du -k "$KEEP"/data/checkpoints/*.jnl > "$KEEP/journal_at_kill" 2>&1 || true
    kill -KILL "$engine"
    date +%s.%N > "$KEEP/killed_at"
  ) < /dev/null > /dev/null 2>&1 &
  disown
  exit 0
}
trap crash TERM
wait "$engine"
