#!/usr/bin/env bash
# Fetches, here, the wheels bench/gpu_check.sh installs on a lent GPU machine (CPython 3.12, x86-64,
# no network there), and Megatron-LM 0.16.1's source tree, into .whl/, which git ignores and the device tool's run carries (carry [".whl"]).
#
#     bash bench/fetch_gpu_wheels.sh
#
# Keeps one version of each (two would stop the install there), prints what each wheel requires
# (to check against the machine's package list, /work/.library/device/KINDS.md) and fails if the
# wheels and the working tree together pass the 64 MiB a run carries.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
[ -x "$py" ] || py=python3
wheels=$(bash bench/gpu_check.sh --print-wheels)
mkdir -p .whl
for w in $wheels; do  # other versions of the same package go
    stem=$(echo "${w%%==*}" | tr - _)
    find .whl -maxdepth 1 -name "${stem}-*.whl" ! -name "${stem}-${w##*==}-*" -print -delete
done
# deepspeed publishes no wheel: built here (pure Python; its setup imports torch, hence no isolation)
built=$(echo "$wheels" | tr ' ' '\n' | grep '^deepspeed==' || true)
wheels=$(echo "$wheels" | tr ' ' '\n' | grep -v '^deepspeed==' | tr '\n' ' ')
if [ -n "$built" ] && ! ls .whl/deepspeed-"${built##*==}"-*.whl >/dev/null 2>&1; then
    DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w .whl "$built"
fi
# shellcheck disable=SC2086
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $wheels
# Megatron-LM's training loop (pretrain_gpt.py, megatron/training) is in its source tree only, not in the
# megatron-core wheel: tests/test_megatron_lm_device.py runs 0.16.1's (BCP_MEGATRON_LM: ../shared/megatron_lm)
tree="${BCP_MEGATRON_LM:-../shared/megatron_lm}/core_v0.16.1"
[ -d "$tree/megatron/training" ] || { echo "no Megatron-LM 0.16.1 tree at $tree (set BCP_MEGATRON_LM)" >&2; exit 1; }
rm -rf .whl/megatron_lm && mkdir -p .whl/megatron_lm
cp -r "$tree" .whl/megatron_lm/ && find .whl/megatron_lm -name __pycache__ -prune -exec rm -rf {} +
echo "megatron_lm/core_v0.16.1 ($(du -sk .whl/megatron_lm | cut -f1) KiB)"
for f in .whl/*.whl; do
    echo "$(basename "$f") ($(du -k "$f" | cut -f1) KiB) requires:" \
        "$(unzip -p "$f" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' | cut -d' ' -f2- |
           tr '\n' ';')"
done
wheels_kib=$(du -sk .whl | cut -f1)
tree_kib=$(git ls-files -z --cached --others --exclude-standard | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
echo "wheels ${wheels_kib} KiB + working tree ${tree_kib} KiB = $(((wheels_kib + tree_kib) / 1024)) MiB of the 64 MiB a run carries"
[ $((wheels_kib + tree_kib)) -le $((64 * 1024)) ] || { echo "too large to carry" >&2; exit 1; }
