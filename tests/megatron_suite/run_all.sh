#!/bin/bash
# run.sh for each release, file and backend in turn (one torchrun job at a time), then summary.py.
#   tests/megatron_suite/run_all.sh [nproc]     (releases: MEGATESTS_RELEASES, files: MEGATESTS_FILES)
# Logs: megatron_suite_results/<release>/<backend>/<file stem>.log
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
PROJECT=$(cd "$HERE/../.." && pwd)
NPROC=${1:-8}
RELEASES=${MEGATESTS_RELEASES:-0.19.0 0.17.1 0.16.1}
FILES=${MEGATESTS_FILES:-test_serialization.py test_async_save.py test_checkpointable.py test_fully_parallel.py \
test_mapping.py test_torch_dist.py test_safe_globals.py test_integrity.py test_validation.py \
test_async_utils_shutdown.py test_rerun_state_machine_ckpt.py}
cd "$PROJECT"
for release in $RELEASES; do
  for file in $FILES; do
    [ -e "$PROJECT/../shared/megatron_lm/core_v$release/tests/unit_tests/dist_checkpointing/$file" ] || continue
    for backend in torch_dist bcp; do
      log=megatron_suite_results/$release/$backend/${file%.py}.log
      mkdir -p "$(dirname "$log")"
      echo "$(date +%T) $release $backend $file"
      "$HERE/run.sh" "$release" "$backend" "$NPROC" "$file" > "$log" 2>&1
      echo "$(date +%T)   exit $? ($(grep -aE '^[=]* ?[0-9]+ (passed|failed)|^[=]* ?[0-9]+ (passed|failed|skipped|error)' "$log" | tail -1))"
    done
  done
done
"${PYTHON:-$PROJECT/.venv/bin/python}" "$HERE/summary.py" "$PROJECT/megatron_suite_results" --failures
