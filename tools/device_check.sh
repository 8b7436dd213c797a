#!/usr/bin/env bash
# One call on the lent GPU machine: build, full test suite with the GPU
# required, compute-sanitizer on small odd shapes (plus the planted race), the
# benchmark, and error and bias against float64 beside jnp's (--accuracy, on
# its default shapes: long K and positive inputs among them). Logs go to $OUT
# (or ./device_out; the logs packed into logs.tgz, the JSON rows and plots as
# they are); the flagged accuracy rows print before the short summary.
#   usage: [STEPS="tests sanitize bench accuracy"] [KERNELS="warptile pipelined"] \
#          [SCALING_ARGS="--dtype bfloat16 --layouts 'K-sharded, replicated' ..."] \
#          (STEPS=scaling: tools/scaling.py, the arguments split as a shell would) \
#          [ACCURACY_KERNELS="auto wgmma"] [ACCURACY_ARGS="--dtype bfloat16 --shapes ..."] \
#          [SKIP_BUILD=1 | PREBUILT=prebuilt] \
#          [TESTS="tests/test_tensor_cores.py" | TEST_SHARD=1/2 | TEST_SHARD=both|each | TEST_IDS=FILE] \
#          [TEST_WORKERS=16] [TEST_TIMEOUT=480] [COMPILE_TESTS=1] \
#          [SANITIZE_JOBS=4] [SANITIZE_TIMEOUT=420] [SANITIZE_TOOLS="memcheck initcheck"] \
#          [BASELINE=docs/perf/<baseline>.json | BASELINE=docs/perf] tools/device_check.sh [bench args...]
# KERNELS limits the sanitizer runs (default: every CUDA kernel), SANITIZE_TOOLS
# their tools (default: memcheck racecheck synccheck initcheck; the planted
# race runs with racecheck only); ACCURACY_KERNELS
# the kernels --accuracy measures (default: auto, what users get); TESTS the
# pytest paths, relative to the repository (default: tests, all of them but
# tests/test_cuda_compile.py, which CI runs: COMPILE_TESTS=1 keeps it), or
# TEST_SHARD=i/n the i-th of n shards of about equal GPU time (n calls, i =
# 1..n, make the whole suite; tools/test_shards.py deals the files by
# tests/gpu_test_seconds.tsv: about 250 s a shard of two with 16 workers, if
# nothing else shares the GPU), or on a machine of two GPUs TEST_SHARD=both:
# the two shards at once, one a GPU (CUDA_VISIBLE_DEVICES), logged apart;
# they share the host, and on two H100s (2026-11-26) the shards ran 540 s
# and more, then about 400 s once the slowest tests started first (the same
# day, at 27f661f): give them TEST_TIMEOUT=500. TEST_SHARD=each: as many shards as
# the machine has GPUs, one a GPU (on four, about half the time of two).
# BASELINE=docs/perf compares with the newest
# baseline of this run's GPU there (tools/compare_baseline.py); given no bench
# args, the bench then runs with that baseline's own.
# One call runs at most 10 minutes: the suite alone takes about 7 with 16
# workers, so split the steps over calls made back to back (the machine stays
# warm 30 s), the later ones with SKIP_BUILD=1 (the installed build is reused;
# CMAKE_ARGS=-DCMAKE_CUDA_ARCHITECTURES=90a builds Hopper only, in about two
# minutes). A machine idle 30 s is given back and the next call builds again
# on a fresh one: build a wheel here first (tools/prebuild_hopper.sh), carry
# its folder and pass PREBUILT=prebuilt, and each fresh machine installs it in
# seconds. Each test's result is logged as it ends (pytest -v), so a run cut
# short by its timeout still names the tests that failed.
set -uo pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
# PYTHONSAFEPATH: Python run here, in the repository root, imports the installed
# package, not the uncompiled source tree jax_tiled/ (as `python -P`).
export CMAKE_BUILD_PARALLEL_LEVEL=16 PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
steps=${STEPS:-tests sanitize bench accuracy}
summary=()
note() { summary+=("$1"); echo "== $1"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/device.txt"

# What was built, named by its sources (tools/sources_hash.sh; compare with
# the same script run here on a clean tree).
sources=$(bash tools/sources_hash.sh) || { echo "tools/sources_hash.sh failed"; exit 1; }
built_stamp=${TMPDIR:-/tmp}/jax_tiled_built_sources  # outlives the call, as the build does
# A wheel built here by tools/prebuild_hopper.sh (carried: PREBUILT=prebuilt),
# installed where it is of these sources and this machine's nvcc release
# (the same compiler makes the same kernels): a fresh machine then spends
# seconds, not minutes, before the steps. Else the tree is built here, as
# without it, and the reason printed.
prebuilt_wheel() {
  local dir=${PREBUILT:-}
  [[ -n $dir ]] || return 1
  local wheel=("$dir"/jax_tiled-*.whl)
  if [[ ! -f ${wheel[0]} || ! -f $dir/SOURCES || ! -f $dir/NVCC ]]; then
    echo "PREBUILT: no wheel with SOURCES and NVCC in $dir (carried?): building here"; return 1
  fi
  if [[ $(cat "$dir/SOURCES") != "$sources" ]]; then
    echo "PREBUILT: the wheel is of sources $(cat "$dir/SOURCES"), the tree's are $sources: building here"
    return 1
  fi
  local nvcc_here
  nvcc_here=$(nvcc --version | grep release)
  if [[ $(cat "$dir/NVCC") != "$nvcc_here" ]]; then
    echo "PREBUILT: built by '$(cat "$dir/NVCC")', this machine has '$nvcc_here': building here"
    return 1
  fi
  python3 -m pip install --no-deps --force-reinstall "${wheel[0]}" >"$OUT/build.log" 2>&1 \
    || { tail -5 "$OUT/build.log"; echo "PREBUILT: the wheel did not install: building here"; return 1; }
}
if [[ -n "${SKIP_BUILD:-}" ]]; then
  if [[ ! -f $built_stamp ]] || ! python3 -c "import jax_tiled" 2>/dev/null; then
    echo "SKIP_BUILD: nothing built on this machine (a fresh one: the last was given back after 30 s idle); run without SKIP_BUILD"
    exit 1
  fi
  if [[ $(cat "$built_stamp") != "$sources" ]]; then
    echo "SKIP_BUILD: the installed build is of sources $(cat "$built_stamp"), the tree's are $sources; run without SKIP_BUILD"
    exit 1
  fi
  note "build: skipped, the installed one (sources $sources) reused"
elif prebuilt_wheel; then
  echo "$sources" >"$built_stamp"
  note "build: the wheel built elsewhere for sources $sources installed ($PREBUILT)"
elif ! python3 -m pip install --no-build-isolation -v . >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
else
  echo "$sources" >"$built_stamp"
  note "build: ok (sources $sources, HEAD $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
fi

repo=$PWD

# One pytest run over the paths given, into $OUT/tests<suffix>.log; each
# test's time goes to test_times<suffix>.tsv as it ends (tests/conftest.py),
# and the slowest tests start first, one a worker (JAX_TILED_SLOW_FIRST and
# --maxschedchunk 1, tools/test_shards.py).
# Workers share the GPU: each takes memory as it needs it, not 75% up front.
# A run cut short by TEST_TIMEOUT writes the tests it did not finish to
# tests<suffix>_unfinished.ids (tools/test_shards.py --unfinished), which a
# later call runs alone with TEST_IDS (the file copied into the tree).
# NumPy's BLAS runs on one thread a worker: each worker's float64 references
# would otherwise start a thread a core, 16 workers 256 threads on 16 cores,
# whose idle ones spin (OpenBLAS; cpp/cuda/NOTES.md, "The suite's host
# threads").
run_tests() {
  local suffix=$1 rc
  shift
  OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} \
    MKL_NUM_THREADS=${MKL_NUM_THREADS:-1} \
    JAX_TILED_REQUIRE_GPU=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_TILED_SLOW_FIRST=1 \
    JAX_TILED_TEST_TIMES="$OUT/test_times$suffix.tsv" timeout "${TEST_TIMEOUT:-480}" \
    python3 -m pytest -v -n "${TEST_WORKERS:-16}" --maxschedchunk 1 -p no:cacheprovider --durations=20 \
    "$@" >"$OUT/tests$suffix.log" 2>&1
  rc=$?
  if ((rc == 124)); then
    python3 -m pytest --collect-only -q -p no:cacheprovider "$@" >"$OUT/collected$suffix.txt" 2>&1
    python3 "$repo/tools/test_shards.py" --unfinished "$OUT/test_times$suffix.tsv" \
      "$OUT/collected$suffix.txt" >"$OUT/tests${suffix}_unfinished.ids"
  fi
  return "$rc"
}

# The summary of the run of that suffix, which exited with `rc`.
report_tests() {
  local suffix=$1 rc=$2 log="$OUT/tests$1.log"
  note "tests$suffix (JAX_TILED_REQUIRE_GPU=1): rc=$rc :: $(grep -cE ' PASSED ' "$log") passed, \
$(grep -cE ' (FAILED|ERROR) ' "$log") failed or errors$( ((rc == 124)) && echo ", cut short by TEST_TIMEOUT: \
$(grep -c . "$OUT/tests$1_unfinished.ids") unfinished, in tests$1_unfinished.ids (rerun: TEST_IDS=)")"
  grep -E ' (FAILED|ERROR) ' "$log" | grep -oE 'tests/[^ ]+' | sort -u | head -40
  echo "slowest tests (seconds; all in test_times$suffix.tsv, inside logs.tgz):"
  sort -rn "$OUT/test_times$suffix.tsv" 2>/dev/null | head -12
}

# The whole suite and its shards leave out tests/test_cuda_compile.py
# (COMPILE_TESTS=1 keeps it): its checks run nvcc and ptxas, no GPU, and CI
# runs them on every change with the same nvcc release (a prebuilt wheel is
# installed only where the releases match); on one H200 its six ptxas checks
# took 157-287 s each of the shared cores, and the suite was cut at 500 s
# with 1214 tests not started (2026-11-29, cpp/cuda/NOTES.md, "3xTF32's
# parts split ahead"). TESTS and TEST_IDS run what they name.
COMPILE_CHECKS=tests/test_cuda_compile.py
compile_checks_left_out() { [[ ${COMPILE_TESTS:-} != 1 ]]; }

# The paths of shard "i/n" (tools/test_shards.py deals the files by GPU time).
shard_paths() {
  local files
  files=$(python3 "$repo/tools/test_shards.py" "$1") || return 1
  for t in $files; do
    compile_checks_left_out && [[ $t == "$COMPILE_CHECKS" ]] && continue
    echo "$repo/$t"
  done
}

if [[ " $steps " == *" tests "* ]]; then
  if [[ ${TEST_SHARD:-} == both || ${TEST_SHARD:-} == each ]]; then
    # A machine of several GPUs: as many shards at once (two, or one a GPU),
    # one a GPU.
    gpus=$(nvidia-smi -L | wc -l)
    shards=$([[ $TEST_SHARD == both ]] && echo 2 || echo "$gpus")
    ((shards >= 2 && gpus >= shards)) \
      || { echo "TEST_SHARD=$TEST_SHARD needs two GPUs or more; this machine has $gpus"; exit 1; }
    pids=()
    for ((i = 1; i <= shards; i++)); do
      mapfile -t paths < <(shard_paths "$i/$shards") && ((${#paths[@]})) || exit 1
      CUDA_VISIBLE_DEVICES=$((i - 1)) run_tests "_$i" "${paths[@]}" &
      pids+=($!)
    done
    for ((i = 1; i <= shards; i++)); do
      wait "${pids[i - 1]}"
      report_tests "_$i" $?
    done
  else
    test_paths=()
    if [[ -n "${TEST_SHARD:-}" ]]; then  # "i/n": shard i of n
      mapfile -t test_paths < <(shard_paths "$TEST_SHARD") && ((${#test_paths[@]})) || exit 1
    elif [[ -n "${TEST_IDS:-}" ]]; then  # a file of test ids, one a line (a cut run's unfinished)
      mapfile -t test_paths < <(grep . "$TEST_IDS") && ((${#test_paths[@]})) \
        || { echo "TEST_IDS: no test ids in $TEST_IDS"; exit 1; }
    elif [[ -n "${TESTS:-}" ]]; then
      for t in $TESTS; do test_paths+=("$repo/$t"); done
    else
      test_paths=("$repo/tests")
      compile_checks_left_out && test_paths+=(--ignore "$repo/$COMPILE_CHECKS")
    fi
    run_tests "" "${test_paths[@]}"
    report_tests "" $?
  fi
fi

# Whether this compute-sanitizer offers an option (its --help, read once the
# sanitize step starts): checks beyond its defaults, such as the Hopper
# kernel's bulk (TMA) copies and wgmma operands under memcheck.
offered() { [[ $sanitizer_options == *"$1"* ]]; }

# One sanitizer run: its log, and one line of summary in $OUT/san_<tool>_<kernel>.txt.
sanitize() {
  local tool=$1 kernel=$2 extra=()
  case $tool in
    racecheck) extra=(--racecheck-report all) ;;  # the default analysis report shows no hazards
    # initcheck's check of cudaMemcpy sources is left out: on the H100 each
    # checked copy waited about 3 s (a held stream), which cut every wgmma run
    # short, and it took the TMA-store epilogue's output for uninitialized
    # (it does not see bulk tensor stores as writes), while the same run
    # checks every product's values against float64. Kernels' own reads of
    # uninitialized global memory are still reported.
    initcheck) extra=(--check-api-memory-access no) ;;
    memcheck)
      offered --check-bulk-copy && extra+=(--check-bulk-copy yes)
      offered --check-warpgroup-mma && extra+=(--check-warpgroup-mma yes)
      ;;
  esac
  timeout "${SANITIZE_TIMEOUT:-420}" compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 1 \
    python3 "$repo/tests/scripts/sanitizer_cases.py" "$kernel" >"$OUT/san_${tool}_$kernel.log" 2>&1
  local rc=$?
  echo "compute-sanitizer $tool $kernel: rc=$rc$( ((rc == 124)) && echo ' (cut short by SANITIZE_TIMEOUT)') :: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|products correct' "$OUT/san_${tool}_$kernel.log" | tr '\n' ' ')" \
    >"$OUT/san_${tool}_$kernel.txt"
}

if [[ " $steps " == *" sanitize "* ]]; then
  export XLA_PYTHON_CLIENT_ALLOCATOR=platform
  sanitizer_options=$(compute-sanitizer --help 2>&1)
  # The runs are slow and mostly host-bound: SANITIZE_JOBS of them at a time.
  runs=()
  for kernel in ${KERNELS:-$(python3 -c "import jax_tiled; print(' '.join(jax_tiled.kernels('gpu')))")}; do
    for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}; do runs+=("$tool $kernel"); done
  done
  for run in "${runs[@]}"; do
    while (($(jobs -rp | wc -l) >= ${SANITIZE_JOBS:-4})); do wait -n; done
    # shellcheck disable=SC2086
    sanitize $run &
  done
  wait
  for run in "${runs[@]}"; do
    read -r tool kernel <<<"$run"
    note "$(cat "$OUT/san_${tool}_$kernel.txt")"
  done
  if [[ " ${SANITIZE_TOOLS:-racecheck} " == *" racecheck "* ]]; then
    timeout 600 compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 1 \
      python3 "$repo/tests/scripts/sanitizer_cases.py" --racy >"$OUT/san_racecheck_planted.log" 2>&1
    note "racecheck on the planted race (must be non-zero): rc=$? :: $(grep -E 'ERROR SUMMARY|hazard' "$OUT/san_racecheck_planted.log" | head -3 | tr '\n' ' ')"
  fi
  unset XLA_PYTHON_CLIENT_ALLOCATOR
fi

if [[ " $steps " == *" bench "* ]]; then
  bench_args=("$@")
  # No arguments and a baseline: the baseline's own, so the run measures its
  # rows (without them the benchmark's default is every kernel, for minutes).
  if [[ $# -eq 0 && -n "${BASELINE:-}" ]]; then
    kind=$(python3 -c "import jax; print(jax.devices()[0].device_kind)")
    if line=$(python3 "$repo/tools/compare_baseline.py" "$repo/$BASELINE" --args-for "$kind"); then
      eval "bench_args=($line)"
      note "bench: the arguments of $kind's baseline in $BASELINE: $line"
    else
      note "bench: no baseline of $kind in $BASELINE to take arguments from: the benchmark's defaults"
    fi
  fi
  rm -f "$OUT/bench.json"
  python3 -m jax_tiled.bench "${bench_args[@]}" --json "$OUT/bench.json" \
    --plot "$OUT/bench.png" >"$OUT/bench.log" 2>"$OUT/bench.err"
  note "bench: rc=$?"
  cat "$OUT/bench.log"
  # Every row that lost more than 3% against the peer since the baseline.
  if [[ -n "${BASELINE:-}" && ! -f "$OUT/bench.json" ]]; then
    note "against $BASELINE: not compared: the benchmark wrote no bench.json (bench.err)"
  elif [[ -n "${BASELINE:-}" ]]; then
    python3 "$repo/tools/compare_baseline.py" "$repo/$BASELINE" "$OUT/bench.json" >"$OUT/baseline.log" 2>&1
    note "against $BASELINE: rc=$? :: $(grep -c REGRESSION "$OUT/baseline.log") rows lost more than 3%"
    cat "$OUT/baseline.log"
  fi
fi

if [[ " $steps " == *" accuracy "* ]]; then
  kernel_args=(); for k in ${ACCURACY_KERNELS:-auto}; do kernel_args+=(--kernels "$k"); done
  # No preallocation: it may share the GPU with a test shard, whose 16 workers
  # crashed (segfaults, cuSolver handles not made) beside one holding 75% of it.
  # shellcheck disable=SC2086
  XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m jax_tiled.bench --accuracy --no-progress "${kernel_args[@]}" \
    ${ACCURACY_ARGS:-} --json "$OUT/accuracy.json" >"$OUT/accuracy.log" 2>"$OUT/accuracy.err"
  note "accuracy: rc=$? :: $(grep -E 'rows miss' "$OUT/accuracy.err")"
  grep -E 'ERR|BIAS' "$OUT/accuracy.log" | grep -v '^flag:'
fi

# Multi-GPU scaling (a kind with several GPUs): every layout, ours against jnp on
# the same sharding; the issue's figures are bfloat16 8192^3 at DEFAULT.
if [[ " $steps " == *" scaling "* ]]; then
  # SCALING_ARGS split as a shell splits words, quotes kept: layout names hold
  # spaces (--layouts 'K-sharded, replicated').
  mapfile -t scaling_args < <(python3 -c 'import shlex, sys; print(*shlex.split(sys.argv[1]), sep="\n")' \
    "${SCALING_ARGS:---dtype bfloat16 --precision default --no-overlap}")
  NCCL_NVLS_ENABLE=0 python3 "$repo/tools/scaling.py" "${scaling_args[@]}" \
    --json "$OUT/scaling.json" >"$OUT/scaling.log" 2>&1
  note "scaling: rc=$?"
  cat "$OUT/scaling.log"
fi

# The device tool brings back at most 8 files from $OUT: the logs travel as one
# archive (tar xzf logs.tgz), the JSON rows and plots and a cut run's
# unfinished test ids (*.ids) as they are.
(
  cd "$OUT" || exit
  shopt -s nullglob
  logs=(*.log *.txt *.err *.tsv)
  ((${#logs[@]})) && tar czf logs.tgz "${logs[@]}" && rm -f "${logs[@]}"
)

echo; printf '%s\n' "${summary[@]}"
