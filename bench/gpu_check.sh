#!/usr/bin/env bash
# The GPU check (issue #32) as one command for a lent GPU machine; docs/gpu.md says how to call it.
#
#     bash bench/gpu_check.sh OUT             on the GPU machine (the device tool's run, OUT=$OUT)
#     bash bench/gpu_check.sh OUT --cpu       here: the same steps on CPU (the cuda tests' twins, a tiny bench)
#     bash bench/gpu_check.sh --print-wheels  the wheels it installs (bench/fetch_gpu_wheels.sh fetches them)
#
# Without network: installs the wheels carried in .whl/ and bcp from this working tree, runs
# tests/test_cuda_deepspeed.py, tests/test_megatron_lm_device.py (Megatron-LM's tree carried in
# .whl/megatron_lm), tests/test_device_integrations.py and tests/test_cuda.py (a GPU
# torch cannot see is a failure there), bench/gpu_integrations.py (the first checkpoint step
# through each integration) and bench/gpu.py (bcp against DCP, the floors) within BCP_GPU_CHECK_S seconds (560), and writes into
# OUT: summary.txt, env.txt, pytest.txt, pytest_junit.xml, bench_integrations.json,
# bench_integrations.txt, bench_gpu.json, bench_gpu.txt. Exit status 0 only if the tests and both
# benches passed.
set -uo pipefail

# what bcp's tests need that the GPU machine's image lacks or has older (deepspeed: built here, pure Python; the
# rest of its requirements are in the image)
WHEELS="megatron-core==0.16.1 tenacity==9.2.1 deepspeed==0.19.8 hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5
        annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0"
TOTAL_S=${BCP_GPU_CHECK_S:-560}   # everything, from the install to the summary
TESTS_S=${BCP_GPU_TESTS_S:-330}   # the tests at most (0: no tests)
INTEGRATIONS_S=${BCP_GPU_INTEGRATIONS_S:-80}  # the integrations' bench at most (0: none); bench/gpu.py gets the rest
BENCH_GIB=${BCP_GPU_GIB:-4}       # state sizes of bench/gpu.py, smallest first (BCP_GPU_SYSTEMS: its systems, bcp,dcp)
# the files whose cuda tests have not all passed on a GPU yet first (Megatron-LM's), so a run cut short still tells
TEST_FILES=${BCP_GPU_TEST_FILES:-tests/test_megatron_lm_device.py tests/test_cuda_deepspeed.py tests/test_device_integrations.py tests/test_cuda.py}

if [ "${1:-}" = --print-wheels ]; then
    echo "$WHEELS"
    exit 0
fi
out=${1:?usage: bash bench/gpu_check.sh OUT_DIR [--cpu] | --print-wheels}
mode=${2:-gpu}
cd "$(dirname "$0")/.." || exit 2
repo=$PWD
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
start=$SECONDS
note() { echo "[gpu_check $((SECONDS - start))s] $*" | tee -a "$out/summary.txt"; }

if [ "$mode" = gpu ]; then
    py=python3
    missing=
    for w in $WHEELS; do
        stem=$(echo "${w%%==*}" | tr - _)
        ls ".whl/${stem}-${w##*==}-"*.whl >/dev/null 2>&1 || missing="$missing $w"
    done
    if [ -n "$missing" ]; then
        note "missing in .whl/:$missing (run bash bench/fetch_gpu_wheels.sh beforehand and carry .whl)"
        exit 2
    fi
    # the carried wheels into a directory of their own (the image's packages stay as they are)
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/bcp_site \
        .whl/*.whl >>"$out/env.txt" 2>&1 || { note "installing the carried wheels failed (env.txt)"; exit 2; }
    export PYTHONPATH=/tmp/bcp_site:$repo${PYTHONPATH:+:$PYTHONPATH}
    $py -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$out/env.txt" 2>&1 ||
        note "pip install -e . failed (env.txt); bcp is imported from the working tree (PYTHONPATH)"
    # Megatron-LM 0.16.1's training loop (tests/test_megatron_lm_device.py), carried beside the wheels
    [ -d .whl/megatron_lm/core_v0.16.1 ] && export BCP_MEGATRON_LM=$repo/.whl/megatron_lm
    export BCP_REQUIRE_CUDA=1
    tests="cuda"  # the CPU twins ran where the suite runs
    bench_args="--device cuda --gib $BENCH_GIB --systems ${BCP_GPU_SYSTEMS:-bcp,dcp}"
    integrations_args="--device cuda --gib ${BCP_GPU_INTEGRATIONS_GIB:-2} --runs ${BCP_GPU_INTEGRATIONS:-hf,accelerate,lightning}"
else
    py=${PYTHON:-$repo/.venv/bin/python}
    [ -x "$py" ] || py=python3
    # the carried wheels as the GPU machine's pip sees them (CPython 3.12, x86-64), nothing installed
    $py -m pip install -q --dry-run --no-index --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --target /tmp/bcp_site_check .whl/*.whl \
        >>"$out/env.txt" 2>&1 || { note "the carried wheels do not install for CPython 3.12 x86-64 (env.txt)"; exit 2; }
    tests=""  # every test of the files, the slow cpu twins too
    [ -z "${BCP_MEGATRON_LM:-}" ] && [ -d ../shared/megatron_lm ] && export BCP_MEGATRON_LM=$(cd ../shared/megatron_lm && pwd)
    bench_args="--device cpu --gib 0.0005,0.001 --hidden 128 --steps 6 --every 2 --step-ms 5"
    integrations_args="--device cpu --gib 0.001 --hidden 128 --rows 16 --step-ms 5 --steps 10 --first 3 --every 4"
    INTEGRATIONS_S=${BCP_GPU_INTEGRATIONS_S:-400}  # four fresh processes importing the frameworks, here
    TESTS_S=${BCP_GPU_TESTS_S:-900}                # the CPU twins launch training jobs, on 2 cores
    TOTAL_S=${BCP_GPU_CHECK_S:-1500}
fi
export PYTHONUNBUFFERED=1

$py - >>"$out/env.txt" 2>&1 <<'EOF'
import importlib.metadata as md, platform, sys
import torch
print("python", sys.version.split()[0], platform.machine(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("devices", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
for name in ("bcp-checkpoint", "megatron-core", "tenacity", "transformers", "safetensors", "fsspec", "xxhash", "tqdm",
             "numpy", "pytest", "pytest-xdist", "pytest-timeout", "packaging"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
EOF
{ nvidia-smi 2>&1 | head -15; df -h /tmp | tail -1; free -g 2>/dev/null | head -2; } >>"$out/env.txt"
note "$(grep -E '^(python|devices)' "$out/env.txt" | tr '\n' ' ')"

# 1. the tests marked cuda (here: every test of the files), serially: they share the one GPU; a test
#    that hangs is stopped by pytest-timeout after 150 s (those that launch jobs: their own limit),
#    the whole run after TESTS_S by SIGINT, so pytest still prints the failures so far
tests_rc=0
if [ "$TESTS_S" -gt 0 ]; then
    # shellcheck disable=SC2086
    timeout -s INT -k 20 "$TESTS_S" $py -m pytest $TEST_FILES -o addopts="" -o timeout=150 -n 0 -p no:cacheprovider \
        -m "$tests" -rfEs --junitxml="$out/pytest_junit.xml" >"$out/pytest.txt" 2>&1
    tests_rc=$?
    [ $tests_rc = 124 ] && note "pytest stopped at its limit of ${TESTS_S}s"
    note "pytest (status $tests_rc): $(tail -1 "$out/pytest.txt")"
    grep -E '^(FAILED|ERROR)' "$out/pytest.txt" | head -20 | while read -r line; do note "  $line"; done
else
    note "tests skipped (BCP_GPU_TESTS_S=0)"
fi

# 2. the first checkpoint step through each integration (bench/gpu_integrations.py)
integrations_rc=0
if [ "$INTEGRATIONS_S" -gt 0 ]; then
    # shellcheck disable=SC2086
    timeout -k 10 "$INTEGRATIONS_S" $py bench/gpu_integrations.py $integrations_args \
        --timeout-s $((INTEGRATIONS_S * 2 / 5)) --json "$out/bench_integrations.json" >"$out/bench_integrations.txt" 2>&1
    integrations_rc=$?
    note "integrations bench (status $integrations_rc, ${INTEGRATIONS_S}s allowed)"
    $py - "$out/bench_integrations.json" 2>&1 <<'EOF' | tee -a "$out/summary.txt"
import json, sys
try:
    table = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"  no integrations table: {e}")
c = table["config"]
print(f"  {c['device_name']}, torch {c['torch']}, {c['gib']} GiB, step {c['calibrated_step_s']:.3f} s calibrated "
      f"(repeat {c['repeat']}), {table['total_s']:.0f} s")
for name, r in table["runs"].items():
    if "error" in r:
        print(f"    {name}: failed: {r['error'][-600:]}")
        continue
    ck = ", ".join(f"{x:.2f}" for x in r["ckpt_step_over_normal"])
    print(f"    {name}: step {r['normal_step_s']:.3f} s; step 1 (and preparing) / normal "
          f"{r['first_interval_over_normal']:.2f}; checkpoint steps / normal {ck} (after steps "
          f"{r['checkpoints_after_steps']})")
EOF
    [ -s "$out/bench_integrations.json" ] || integrations_rc=1
else
    note "integrations bench skipped (BCP_GPU_INTEGRATIONS_S=0)"
fi

# 3. the bench against DCP, in what is left of the time
left=$((TOTAL_S - (SECONDS - start) - 20))
bench_rc=0
if [ $left -lt 60 ]; then
    note "no time left for the bench (${left}s)"
    bench_rc=1
else
    timeout -k 10 "$left" $py bench/gpu.py $bench_args --budget-s $((left - 15)) --json "$out/bench_gpu.json" \
        >"$out/bench_gpu.txt" 2>&1
    bench_rc=$?
    note "bench (status $bench_rc, ${left}s allowed)"
    $py - "$out/bench_gpu.json" 2>&1 <<'EOF' | tee -a "$out/summary.txt"
import json, sys
try:
    table = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"  no bench table: {e}")
print(f"  {table['config']['device_name']}, torch {table['config']['torch']}, {table['total_s']:.0f} s")


def secs(xs):
    return ", ".join("-" if x is None else f"{x:.3f}" for x in xs)


for gib, size in table["sizes"].items():
    print(f"  {gib} GiB: {size['state_gib']:.2f} GiB in {size['tensors']} tensors, {size['rows']} rows a step")
    for name in ("bcp", "bcp_prepared", "dcp"):
        r = size.get(name)
        if r is None:
            continue
        if "error" in r:
            print(f"    {name}: failed: {r['error']}")
            continue
        print(f"    {name}: step {r['normal_step_s']:.3f} s; call {secs(r['save_call_s'])} s; durable "
              f"{secs(r['durable_s'])} s; ckpt step / normal {r['first_ckpt_step_over_normal']:.2f} first, "
              f"{r['later_ckpt_step_over_normal']:.2f} later; save {r['sync_save_gib_s']:.2f} GiB/s; load "
              f"{r['load_cold_gib_s']:.2f} cold, {r['load_warm_gib_s']:.2f} warm GiB/s; exact {r['loaded_exactly']}; "
              f"pinned {r['pinned_peak_gib']:.2f} GiB" + (f"; prepare {r['prepare_s']:.2f} s" if "prepare_s" in r else "")
              + (f"; warm load by threads: {r['load_threads']} (default) {r['load_warm_gib_s']:.2f}, "
                 + ", ".join(f"{k.split('_')[2]} {v:.2f}" for k, v in r.items()
                             if k.startswith("load_warm_") and k.endswith("_threads_gib_s")) + " GiB/s"
                 if "load_threads" in r else "")
              + (f"; a stager per save (torch {table['config']['torch']}, pytorch#183413)"
                 if r.get("config", {}).get("stager_per_save") else "")
              + (f"; errors {r['errors']}" if r.get("errors") else "")
              + (f"; saves of the loop that failed: {r['save_errors']}" if r.get("save_errors") else ""))
    print("    floors GiB/s: " + ", ".join(f"{k} {v:.2f}" for k, v in size["floors"].items() if k.endswith("gib_s"))
          + "; " + ", ".join(f"{k} {v:.3f}" for k, v in size["floors"].items() if k.startswith("fork_")))
    print("    ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in size["ratios"].items()))
for s in table["skipped"]:
    print(f"  skipped {s['gib']} GiB: {s['why']}")
EOF
fi
note "done in $((SECONDS - start))s; results in $out"
[ $tests_rc = 0 ] && [ $integrations_rc = 0 ] && [ $bench_rc = 0 ]
