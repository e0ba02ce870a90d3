#!/bin/bash
# Megatron-LM's own dist_checkpointing unit tests on CPU/gloo, torch_dist or bcp (README.md beside this).
#   tests/megatron_suite/run.sh <release> <torch_dist|bcp> <nproc> <test files or node ids...>
#   e.g. tests/megatron_suite/run.sh 0.19.0 bcp 8 test_serialization.py
# Run from the project root. <release>: 0.16.1, 0.17.1 or 0.19.0, a tree core_v<release>/ under
# $BCP_MEGATRON_LM (default ../shared/megatron_lm). The tree is copied once to
# $MEGATESTS_WORK (default $TMPDIR/bcp_megatron_suite) and ../shared/megatron_suite/cpu_devices.diff
# applied to the copy (it applies to all three with offsets). A test file given by name is looked up
# in tests/unit_tests/dist_checkpointing/. JUnit XML per rank: megatron_suite_results/<release>/<backend>/<tag>/
# (tag: MEGATESTS_TAG, else the first argument's file stem); tests/megatron_suite/summary.py tabulates them.
# Environment: MEGATESTS_TIMEOUT (per test, s; 300), MEGATESTS_PG_TIMEOUT (gloo, s; 120), MASTER_PORT.
set -u
if [ $# -lt 4 ]; then sed -n 2,4p "$0"; exit 2; fi
RELEASE=$1; BACKEND=$2; NPROC=$3; shift 3
HERE=$(cd "$(dirname "$0")" && pwd)
PROJECT=$(cd "$HERE/../.." && pwd)
PYTHON=${PYTHON:-$PROJECT/.venv/bin/python}
SOURCES=${BCP_MEGATRON_LM:-$PROJECT/../shared/megatron_lm}
DIFF=${MEGATESTS_DIFF:-$SOURCES/../megatron_suite/cpu_devices.diff}
case $BACKEND in torch_dist|bcp) ;; *) echo "backend must be torch_dist or bcp, not $BACKEND"; exit 2;; esac
[ -d "$SOURCES/core_v$RELEASE/megatron/core" ] || { echo "no Megatron-LM tree $SOURCES/core_v$RELEASE"; exit 2; }
[ -f "$DIFF" ] || { echo "no $DIFF"; exit 2; }

WORK=${MEGATESTS_WORK:-$("$PYTHON" -c "import tempfile; print(tempfile.gettempdir())")/bcp_megatron_suite}
TREE=$WORK/mlm-core_v$RELEASE
if [ ! -f "$TREE/.patched" ]; then
  rm -rf "$TREE" && mkdir -p "$TREE" && cp -r "$SOURCES/core_v$RELEASE/." "$TREE/" && chmod -R u+w "$TREE" \
    && (cd "$TREE" && patch -s -p0 -F 2 --no-backup-if-mismatch < "$DIFF") && touch "$TREE/.patched" \
    || { echo "could not prepare $TREE"; exit 1; }
fi

TAG=${MEGATESTS_TAG:-$(basename "${1%%::*}" .py)}
export MEGATESTS_BACKEND=$BACKEND
export MEGATESTS_JUNIT_DIR=$PROJECT/megatron_suite_results/$RELEASE/$BACKEND/$TAG
export MEGATESTS_TEMPROOT=$WORK/tmp/$RELEASE-$BACKEND-$TAG
# the tree first (it shadows the installed megatron-core), then this plugin, the Python 3.11
# stand-ins the 0.17+ trees need (sitecustomize), and bcp
export PYTHONPATH=$TREE:$HERE:$PROJECT/tests/megatron_py311:$PROJECT
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
rm -rf "$MEGATESTS_JUNIT_DIR" "$MEGATESTS_TEMPROOT"; mkdir -p "$MEGATESTS_TEMPROOT"

ARGS=()
for a in "$@"; do
  if [ -e "$TREE/tests/unit_tests/dist_checkpointing/${a%%::*}" ]; then
    ARGS+=("tests/unit_tests/dist_checkpointing/$a"); else ARGS+=("$a"); fi
done
cd "$TREE"
exec "$PYTHON" -m torch.distributed.run --nproc_per_node "$NPROC" --master_addr localhost \
  --master_port "${MASTER_PORT:-$((29500 + RANDOM % 2000))}" \
  -m pytest -p megatests_plugin -o addopts="" -o timeout_func_only=true -p no:cacheprovider -rA -q \
  --timeout="${MEGATESTS_TIMEOUT:-300}" "${ARGS[@]}"
