#!/usr/bin/env bash
# One line per set-up step: `step.sh LOG "what" command...` runs the command with its output
# appended to LOG and prints "what ... ok"; on failure it prints the log's tail and fails.
set -uo pipefail
log="$1"; what="$2"; shift 2
mkdir -p "$(dirname "$log")"
printf '%s ... ' "$what"
{ echo "=== $what: $*"; } >>"$log"
if "$@" >>"$log" 2>&1; then
  echo ok
else
  status=$?
  echo "FAILED (exit $status)"
  echo "--- last lines of $log ---"
  tail -n 40 "$log"
  echo "--- the whole log: $log ---"
  exit "$status"
fi
