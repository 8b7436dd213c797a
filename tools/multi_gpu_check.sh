#!/usr/bin/env bash
# The checks a change to a path `auto` takes needs before it lands, on a
# machine of two GPUs or more, in two device calls made back to back (a
# prebuilt wheel installs in seconds):
#   run(command="PREBUILT=prebuilt tools/multi_gpu_check.sh", kind="nvidia-h100-x4",
#       carry=["prebuilt"])
#   run(command="MODE=timing AB_BEFORE=prebuilt_before AB_ARGS='--dtype bfloat16 --shapes ...' \
#       tools/multi_gpu_check.sh", kind="nvidia-h100-x4", carry=["prebuilt", "prebuilt_before"])
# MODE=check (the default): the build installed (tools/device_check.sh
# STEPS=none: PREBUILT's wheel, else built), the suite in as many shards as
# the machine has GPUs, all at once, one a GPU (TEST_SHARD=each;
# TEST_TIMEOUT, default 540 s), then the sanitizers on KERNELS (default
# wgmma) on GPU 0 beside device_check.sh's accuracy step (`--accuracy`,
# with ACCURACY_ARGS: its default shapes if none) on GPU 1, then the GPU tests
# of tests/test_sharding.py on every GPU (those of two GPUs, which a shard of
# one GPU skips; SEVERAL_GPUS_TIMEOUT, default 120 s). On two H100s
# (2026-11-26) the two shards took 540 s and more, which left the
# sanitizers (about 100 s) to a call of their own; with the slowest tests
# first (27f661f, the same day) about 400 s, so the whole check may just fit
# one call there (not yet run so). On four H100s the same
# day three quarters took about 245 s and the fourth was cut at 420 s by one
# nvcc test that had started late, which now starts first (gpu_slow_tests.tsv);
# the sanitizers and --accuracy took about 100 s after, so with TEST_TIMEOUT=300
# the whole check should fit one call there. Run so on 2026-11-27 (235a637,
# TEST_TIMEOUT=330): three shards finished, the second was cut with 6 of its
# 268 tests unfinished (nvcc's ptxas checks, slow beside the other shards'
# workers), and the whole call took 505 s: TEST_TIMEOUT=400 fits, and a cut
# shard's unfinished tests run alone on a later call (TEST_IDS). A machine of
# several GPUs costs its held time once, not once a GPU.
# MODE=timing: the benchmark against BASELINE (default docs/perf), then, given
# AB_BEFORE (a folder with the wheel of the build before) and AB_ARGS (the
# bench's arguments), tools/ab_bench.py against it, the installed build being
# the one after; both on GPU 0, one at a time: beside the sanitizers, or
# beside ab_bench on the other GPU, small rows' samples spread over twice
# their median (2026-11-26).
# Each step logs under $OUT/<step>/; everything is packed into $OUT/all.tgz
# (the device tool brings back at most 8 files), the JSON rows and any
# unfinished test ids beside it; the summaries are printed. The exit status is non-zero where a step failed (a
# test, a sanitizer run, the --accuracy rows, a row that lost more than 3%
# against the baseline, an A/B process).
# DEVICE_CHECK names the script the steps run (a stand-in in the tests).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$PWD/device_out}
work=$OUT/steps
mkdir -p "$work"
check=${DEVICE_CHECK:-$repo/tools/device_check.sh}
export PYTHONSAFEPATH=1  # the installed package, not the source tree

# device_check.sh with the given settings, its output to <step>.txt and its
# logs under <step>/; prints its summary lines. Non-zero where the script
# failed or a summary line gives a non-zero rc (the planted race's must be).
step() {
  local name=$1
  shift
  env "$@" OUT="$work/$name" bash "$check" >"$work/$name.txt" 2>&1
  local rc=$?
  grep -E '^== ' "$work/$name.txt"
  ((rc == 0)) || return "$rc"
  ! grep -E '^== ' "$work/$name.txt" | grep -v 'planted race' | grep -qE 'rc=[1-9]'
}

# Everything under $work as one archive, the steps' JSON rows and a cut
# shard's unfinished test ids (tests_<i>_unfinished.ids: rerun them with
# TEST_IDS) beside it (ab_bench's JSON, one a process, only in the archive:
# the device tool brings back at most 8 files).
pack() {
  find "$work" \( -name '*.json' -o -name '*.ids' \) -not -path '*/ab/*' -exec cp {} "$OUT/" \;
  tar czf "$OUT/all.tgz" -C "$OUT" steps && rm -rf "$work"
}
trap pack EXIT
status=0

if ! python3 -c "import jax_tiled" 2>/dev/null || [[ -n ${PREBUILT:-} ]]; then
  step install STEPS=none || { tail -20 "$work/install.txt"; exit 1; }
fi

case ${MODE:-check} in
  check)
    step tests STEPS=tests SKIP_BUILD=1 TEST_SHARD=each "TEST_TIMEOUT=${TEST_TIMEOUT:-540}" \
      || status=1
    grep -E '^tests/' "$work/tests.txt" | head -40  # the failed tests, by name
    step sanitize STEPS=sanitize SKIP_BUILD=1 CUDA_VISIBLE_DEVICES=0 \
      "KERNELS=${KERNELS:-wgmma}" >"$work/sanitize.summary" &
    sanitizing=$!
    step accuracy STEPS=accuracy SKIP_BUILD=1 CUDA_VISIBLE_DEVICES=1 \
      "ACCURACY_ARGS=${ACCURACY_ARGS:-}" >"$work/accuracy.summary" &
    measuring=$!
    wait "$sanitizing" || status=1
    wait "$measuring" || status=1
    cat "$work/sanitize.summary" "$work/accuracy.summary"
    # The tests that need two GPUs or more (the sharded products on CUDA),
    # which every shard above skips with one GPU visible: every GPU, two workers.
    step several_gpus STEPS=tests SKIP_BUILD=1 TESTS=tests/test_sharding.py TEST_WORKERS=2 \
      "PYTEST_ADDOPTS=-m gpu" "TEST_TIMEOUT=${SEVERAL_GPUS_TIMEOUT:-120}" || status=1
    grep -E '^tests/' "$work/several_gpus.txt" | head -20
    ;;
  timing)
    step bench STEPS=bench SKIP_BUILD=1 CUDA_VISIBLE_DEVICES=0 \
      "BASELINE=${BASELINE:-docs/perf}" || status=1
    grep -E 'REGRESSION' "$work/bench.txt" || true
    if [[ -n ${AB_BEFORE:-} && -n ${AB_ARGS:-} ]]; then
      mkdir -p "$work/ab"
      wheel=("$AB_BEFORE"/jax_tiled-*.whl)
      # shellcheck disable=SC2086
      CUDA_VISIBLE_DEVICES=0 python3 "$repo/tools/ab_bench.py" "${wheel[0]}" --after-installed \
        --rounds "${AB_ROUNDS:-3}" --out "$work/ab" -- $AB_ARGS >"$work/ab.txt" 2>&1
      rc=$?
      echo "== ab_bench: rc=$rc"
      ((rc == 0)) || status=1
      python3 "$repo/tools/ab_bench.py" unused --summarize --out "$work/ab"
    elif [[ -n ${AB_BEFORE:-}${AB_ARGS:-} ]]; then
      echo "ab_bench needs both AB_BEFORE and AB_ARGS"
      status=2
    fi
    ;;
  *)
    echo "MODE must be check or timing, got ${MODE}"
    exit 2
    ;;
esac
exit $status
