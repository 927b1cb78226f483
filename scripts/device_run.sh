#!/usr/bin/env bash
# End-to-end run on a machine with an NVIDIA GPU (no internet needed):
#   1. build     configure + ninja into build-device (sm_90a), or reuse BUILD_DIR=... as given
#   2. gpu tests ctest -L gpu (or the gtest binary directly when the build folder was configured
#                at another path, e.g. built elsewhere and copied here)
#   3. memcheck  compute-sanitizer --tool memcheck over the GPU test binary
#      racecheck compute-sanitizer --tool racecheck, on a reduced set (slow)
#   4. bench     mla-bench --device cuda --sweep decode (and prefill when supported), JSON out;
#                then, with AB_BUILDS, a same-call A/B of other builds (scripts/ab_decode.py),
#                and with NCU_CASES, ncu (clocks as they are) of the kernels of chosen rows
#   5. summary   a table of step, result (PASS/FAIL/SKIP), seconds and counts, printed last
# Logs and JSON go to ${OUT:-./device-out}, packed into device-run.tgz at the end. Exits non-zero
# when any step failed; the table is printed in every case.
#
# Environment:
#   BUILD_DIR              reuse this build folder (must contain tests/mla_gpu_tests)
#   MLA_CUDA_ARCHS         architectures for a fresh build (default 90a)
#   CTEST_JOBS             parallel ctest processes (default 4)
#   GPU_TEST_FILTER        run the gtest binary directly with this filter instead of ctest (ctest
#                          is used when unset and the build folder was configured at this path)
#   GPU_SANITIZE_FILTER    gtest filter for memcheck (default *-*DeathTest*: every GPU test but the
#                          death tests, whose forked children hung under the sanitizer until its
#                          time limit)
#   GPU_RACECHECK_FILTER   gtest filter for racecheck (default: the first test of every suite of
#                          GPU_SANITIZE_FILTER)
#   SKIP_SANITIZERS=1, SKIP_BENCH=1   leave those steps out (reported as SKIP)
#   BENCH_SWEEPS           mla-bench sweeps to run (default "decode prefill")
#   BENCH_ARGS             more mla-bench options, e.g. "--deterministic on" (decode rows of the
#                          deterministic mode) or "--flush read"
#   BENCH_DECODE_PARTS=N   run the decode sweep as N parts (--part K/N), each its own JSON;
#   BENCH_DECODE_PART=K/N  or only part K (merge the JSONs with bench/merge_results.py)
#   AB_BUILDS, AB_CASES, AB_ROUNDS, AB_DEADLINE_S   an A/B of other mla-bench builds against
#                          this one (step 4b; scripts/ab_decode.py)
#   NCU_CASES, NCU_KERNELS, NCU_LAUNCHES, NCU_TIMEOUT_S   ncu of chosen rows (step 4c)
#   NCU_SOURCE=1           also the warp stall samples by instruction of one launch a row
#                          (SourceCounters; the summary of scripts/ncu_stalls.py), after
#                          NCU_SOURCE_SKIP launches (default 4)
#   NCU_EXTRA              more ncu options for those rows, e.g. "--section SchedulerStats
#                          --section MemoryWorkloadAnalysis_Tables --metrics smsp__inst_executed_pipe_lsu.sum"
#   SANITIZE_TIMEOUT_S, BENCH_TIMEOUT_S, TEST_TIMEOUT_S   per-step time limits in seconds
#   PACK_OUTPUT=0          leave the logs and JSON as files (default: one device-run.tgz at the end)
set -euo pipefail

SRC_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
OUT_DIR="${OUT:-./device-out}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd -P)"
cd "$SRC_DIR"

STEPS=() RESULTS=() SECONDS_TAKEN=() COUNTS=()
record() {  # step result seconds counts
  STEPS+=("$1") RESULTS+=("$2") SECONDS_TAKEN+=("$3") COUNTS+=("$4")
}
print_summary() {
  local status=$? failed=0 i
  echo
  echo "==================== device run summary ($(date -u +%FT%TZ)) ===================="
  printf '%-13s %-6s %8s  %s\n' "step" "result" "seconds" "counts"
  printf '%-13s %-6s %8s  %s\n' "----" "------" "-------" "------"
  for i in "${!STEPS[@]}"; do
    printf '%-13s %-6s %8s  %s\n' "${STEPS[$i]}" "${RESULTS[$i]}" "${SECONDS_TAKEN[$i]}" "${COUNTS[$i]}"
    [[ "${RESULTS[$i]}" == FAIL ]] && failed=1
  done
  if ((status != 0 && failed == 0)); then
    printf '%-13s %-6s %8s  %s\n' "script" "FAIL" "-" "aborted with status $status (see $OUT_DIR)"
    failed=1
  fi
  # One archive of every log and JSON (a machine that hands back only a few files loses none),
  # unless PACK_OUTPUT=0.
  if [[ "${PACK_OUTPUT:-1}" == 1 ]]; then
    local files
    files="$(cd "$OUT_DIR" && find . -maxdepth 1 -type f ! -name device-run.tgz -printf '%P\n' | sort)"
    if [[ -n "$files" ]] && (cd "$OUT_DIR" && tar czf device-run.tgz $files); then
      (cd "$OUT_DIR" && rm -f $files)
      echo "logs: $OUT_DIR/device-run.tgz"
    else
      echo "logs: $OUT_DIR"
    fi
  else
    echo "logs: $OUT_DIR"
  fi
  ((failed == 0)) || exit 1
  exit 0
}
trap print_summary EXIT

now() { date +%s; }
find_tool() {  # name -> path, searching PATH then the CUDA toolkit
  local t
  t="$(command -v "$1" 2>/dev/null || true)"
  [[ -z "$t" && -x "/usr/local/cuda/bin/$1" ]] && t="/usr/local/cuda/bin/$1"
  if [[ -z "$t" ]]; then
    for c in /usr/local/cuda-*/bin/"$1"; do [[ -x "$c" ]] && { t="$c"; break; }; done
  fi
  echo "$t"
}

# Counts from a gtest log: "P passed, F failed, S skipped".
gtest_counts() {
  local log="$1" passed failed skipped
  passed="$(grep -Eo '^\[  PASSED  \] [0-9]+' "$log" | grep -Eo '[0-9]+$' | tail -1 || true)"
  failed="$(grep -Eo '^\[  FAILED  \] [0-9]+ test' "$log" | grep -Eo '[0-9]+' | tail -1 || true)"
  skipped="$(grep -Eo '^\[  SKIPPED \] [0-9]+ test' "$log" | grep -Eo '[0-9]+' | tail -1 || true)"
  echo "${passed:-0} passed, ${failed:-0} failed, ${skipped:-0} skipped"
}

# ---- 1. build --------------------------------------------------------------------------------
t0=$(now)
if [[ -n "${BUILD_DIR:-}" ]]; then
  BUILD_DIR="$(cd "$BUILD_DIR" 2>/dev/null && pwd -P || echo "$BUILD_DIR")"
  if [[ -x "$BUILD_DIR/tests/mla_gpu_tests" ]]; then
    record build SKIP 0 "reused BUILD_DIR=$BUILD_DIR"
  else
    record build FAIL 0 "BUILD_DIR=$BUILD_DIR has no tests/mla_gpu_tests"
    exit 1
  fi
else
  BUILD_DIR="$SRC_DIR/build-device"
  rc=0
  CMAKE="$(find_tool cmake)" NINJA="$(find_tool ninja)" NVCC="$(find_tool nvcc)"
  if [[ -z "$CMAKE" || -z "$NINJA" || -z "$NVCC" ]]; then
    echo "missing tools: cmake='$CMAKE' ninja='$NINJA' nvcc='$NVCC'" | tee "$OUT_DIR/build.log"
    rc=1
  else
    {
      "$CMAKE" -S "$SRC_DIR" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DMLA_ENABLE_CUDA=ON -DMLA_CUDA_ARCHS="${MLA_CUDA_ARCHS:-90a}" \
        -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_MAKE_PROGRAM="$NINJA" &&
        "$NINJA" -C "$BUILD_DIR" -j"$(nproc)"
    } >"$OUT_DIR/build.log" 2>&1 || rc=$?
  fi
  warnings="$(grep -c 'warning' "$OUT_DIR/build.log" || true)"
  if ((rc == 0)) && [[ -x "$BUILD_DIR/tests/mla_gpu_tests" ]]; then
    record build PASS $(($(now) - t0)) "$BUILD_DIR, ${warnings:-0} warning lines"
  else
    tail -30 "$OUT_DIR/build.log" || true
    record build FAIL $(($(now) - t0)) "exit $rc, see build.log"
    exit 1
  fi
fi
GPU_TESTS="$BUILD_DIR/tests/mla_gpu_tests"

echo "== device"
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true) |
  tee "$OUT_DIR/device.txt"

# ---- 2. GPU tests ----------------------------------------------------------------------------
t0=$(now)
configured_src="$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$BUILD_DIR/CMakeCache.txt" 2>/dev/null || true)"
rc=0
if [[ -z "${GPU_TEST_FILTER:-}" && "$configured_src" == "$SRC_DIR" ]] && command -v ctest >/dev/null 2>&1; then
  echo "== ctest -L gpu"
  timeout "${TEST_TIMEOUT_S:-1800}" ctest --test-dir "$BUILD_DIR" -L gpu --output-on-failure \
    -j "${CTEST_JOBS:-4}" --timeout 600 >"$OUT_DIR/gpu_tests.log" 2>&1 || rc=$?
  summary_line="$(grep -E 'tests passed, [0-9]+ tests failed out of [0-9]+' "$OUT_DIR/gpu_tests.log" | tail -1 || true)"
  total="$(grep -Eo 'out of [0-9]+' <<<"$summary_line" | grep -Eo '[0-9]+' || echo 0)"
  nfailed="$(grep -Eo '[0-9]+ tests failed' <<<"$summary_line" | grep -Eo '^[0-9]+' || echo '?')"
  npassed="$(grep -cE 'Test +#[0-9]+: .* Passed' "$OUT_DIR/gpu_tests.log" || true)"
  nskipped="$(grep -c '\*\*\*Skipped' "$OUT_DIR/gpu_tests.log" || true)"
  counts="ctest: ${npassed:-0} passed, ${nfailed} failed, ${nskipped:-0} skipped of ${total:-0}"
  if ((rc == 0)) && [[ "${total:-0}" == 0 ]]; then rc=1; fi  # no GPU tests found is a failure
  if ((rc == 0)) && [[ "${npassed:-0}" == 0 ]]; then rc=-1; fi  # all skipped
else
  echo "== $GPU_TESTS --gtest_filter=${GPU_TEST_FILTER:-*} (build folder configured at '${configured_src:-?}')"
  timeout "${TEST_TIMEOUT_S:-1800}" "$GPU_TESTS" --gtest_filter="${GPU_TEST_FILTER:-*}" \
    --gtest_output="xml:$OUT_DIR/gpu_tests.xml" >"$OUT_DIR/gpu_tests.log" 2>&1 || rc=$?
  counts="gtest: $(gtest_counts "$OUT_DIR/gpu_tests.log")"
  if ((rc == 0)) && [[ "$counts" == "gtest: 0 passed, 0 failed"* ]]; then rc=-1; fi  # all skipped
fi
tail -25 "$OUT_DIR/gpu_tests.log" || true
grep -h '^\[ info \]' "$OUT_DIR/gpu_tests.log" | head -20 || true
result=PASS
((rc == 0)) || result=FAIL
((rc == -1)) && result=SKIP  # every test skipped itself (no usable GPU)
record "gpu tests" "$result" $(($(now) - t0)) "$counts"

# ---- 3. compute-sanitizer --------------------------------------------------------------------
SANITIZER="$(find_tool compute-sanitizer)"
run_sanitizer() {  # tool filter
  local tool="$1" filter="$2" log="$OUT_DIR/$1.log" rc=0 t0 errors
  t0=$(now)
  echo "== compute-sanitizer --tool $tool (filter $filter)"
  # API errors are not reported: some tests provoke them on purpose (and every API error reaches
  # the tests anyway, as mla::Error through MLA_CUDA_CHECK); memory and race errors fail the step.
  timeout "${SANITIZE_TIMEOUT_S:-1800}" "$SANITIZER" --tool "$tool" --error-exitcode 1 \
    --report-api-errors no "$GPU_TESTS" --gtest_filter="$filter" >"$log" 2>&1 || rc=$?
  tail -8 "$log" || true
  if [[ "$tool" == racecheck ]]; then
    errors="$(grep -Eo 'RACECHECK SUMMARY: [0-9]+ hazard[s]? displayed \([0-9]+ error' "$log" | grep -Eo '[0-9]+ error' | grep -Eo '[0-9]+' | tail -1 || true)"
  else
    errors="$(grep -Eo 'ERROR SUMMARY: [0-9]+ error' "$log" | grep -Eo '[0-9]+' | tail -1 || true)"
  fi
  local note=""
  ((rc == 124)) && note=", timed out"
  record "$tool" "$( ((rc == 0)) && echo PASS || echo FAIL)" $(($(now) - t0)) \
    "${errors:-?} errors; $(gtest_counts "$log")$note; filter $filter"
}
if [[ "${SKIP_SANITIZERS:-0}" == 1 ]]; then
  record memcheck SKIP 0 "SKIP_SANITIZERS=1"
  record racecheck SKIP 0 "SKIP_SANITIZERS=1"
elif [[ -z "$SANITIZER" ]]; then
  record memcheck SKIP 0 "compute-sanitizer not found"
  record racecheck SKIP 0 "compute-sanitizer not found"
else
  SANITIZE_FILTER="${GPU_SANITIZE_FILTER:-*-*DeathTest*}"
  run_sanitizer memcheck "$SANITIZE_FILTER"
  if [[ -z "${GPU_RACECHECK_FILTER:-}" ]]; then
    # The first test of every suite: each kernel family once, at a fraction of the full cost; and
    # the Hopper kernel's pipeline edges small enough for the race checker (the fp8 converters on
    # both tile classes, item changes, partial tiles).
    GPU_RACECHECK_FILTER="$("$GPU_TESTS" --gtest_list_tests --gtest_filter="$SANITIZE_FILTER" |
      awk '/^[^ ]/ { suite = $1; first = 1; next } first && /^  / { print suite $1; first = 0 }' |
      paste -sd: - || true)"
    if [[ -z "${GPU_SANITIZE_FILTER:-}" ]]; then
      GPU_RACECHECK_FILTER+=":GpuDecodeHopper.Fp8CacheSmall*:GpuDecodeHopper.ManyItemsPerCta"
      GPU_RACECHECK_FILTER+=":GpuDecodeHopper.KvLengthsAroundTilesAndPages:GpuDecodeHopper.RisingAndFallingScores"
    fi
  fi
  run_sanitizer racecheck "${GPU_RACECHECK_FILTER:-*}"
fi

# ---- 4. mla-bench ----------------------------------------------------------------------------
BENCH="$BUILD_DIR/tools/mla-bench"
run_bench() {  # sweep [part K/N]
  local sweep="$1" part="${2:-}" rc=0 t0 name json
  name="bench_${sweep}${part:+_part${part%/*}of${part#*/}}"
  json="$OUT_DIR/$name.json"
  t0=$(now)
  echo "== mla-bench --device cuda --sweep $sweep${part:+ --part $part}"
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
  timeout "${BENCH_TIMEOUT_S:-1200}" "$BENCH" --device cuda --sweep "$sweep" ${part:+--part "$part"} \
    ${BENCH_ARGS:-} --json "$json" >"$OUT_DIR/$name.log" 2>&1 || rc=$?
  tail -30 "$OUT_DIR/$name.log" || true
  record "bench $sweep${part:+ $part}" "$( ((rc == 0)) && [[ -s "$json" ]] && echo PASS || echo FAIL)" \
    $(($(now) - t0)) "exit $rc, $(basename "$json") $( [[ -s "$json" ]] && wc -c <"$json" || echo 0) bytes"
}
if [[ "${SKIP_BENCH:-0}" == 1 ]]; then
  record bench SKIP 0 "SKIP_BENCH=1"
elif [[ ! -x "$BENCH" ]]; then
  record bench SKIP 0 "no mla-bench in $BUILD_DIR/tools"
else
  # BENCH_SWEEPS picks the sweeps (default: decode prefill); BENCH_DECODE_PARTS=N splits the
  # decode sweep into N runs (or BENCH_DECODE_PART=K/N runs one of them), to be merged with
  # bench/merge_results.py.
  for sweep in ${BENCH_SWEEPS:-decode prefill}; do
    if [[ "$sweep" == decode && -n "${BENCH_DECODE_PART:-}" ]]; then
      run_bench decode "$BENCH_DECODE_PART"
    elif [[ "$sweep" == decode && "${BENCH_DECODE_PARTS:-1}" -gt 1 ]]; then
      for ((k = 1; k <= BENCH_DECODE_PARTS; ++k)); do run_bench decode "$k/$BENCH_DECODE_PARTS"; done
    else
      run_bench "$sweep"
    fi
  done
fi

# ---- 4b. A/B of other builds (optional) --------------------------------------------------------
# AB_BUILDS="tag=path/to/mla-bench ..." (space-separated) runs scripts/ab_decode.py with this
# build's mla-bench as the base ("main") against each, on AB_CASES (mla-bench case options,
# cases separated by ';', e.g. "--heads 128 --batch 1 --kv-len 16384 --rows hopper"), AB_ROUNDS
# rounds (default 3), starting no run after AB_DEADLINE_S seconds (default 300).
if [[ -n "${AB_BUILDS:-}" ]]; then
  t0=$(now)
  ab_args=(--out "$OUT_DIR/ab" --rounds "${AB_ROUNDS:-3}" --deadline "${AB_DEADLINE_S:-300}"
           --build "main=$BENCH")
  for b in $AB_BUILDS; do ab_args+=(--build "$b"); done
  IFS=';' read -r -a ab_cases <<<"${AB_CASES:-}"
  for c in "${ab_cases[@]}"; do [[ -n "${c// /}" ]] && ab_args+=(--case "$c"); done
  rc=0
  echo "== scripts/ab_decode.py ${ab_args[*]}"
  python3 "$SRC_DIR/scripts/ab_decode.py" "${ab_args[@]}" >"$OUT_DIR/ab.log" 2>&1 || rc=$?
  tail -40 "$OUT_DIR/ab.log" || true
  record "a/b" "$( ((rc == 0)) && echo PASS || echo FAIL)" $(($(now) - t0)) \
    "exit $rc, $(wc -w <<<"$AB_BUILDS") builds against main, ${#ab_cases[@]} cases, see ab.log"
fi

# ---- 4c. ncu of chosen rows (optional) ---------------------------------------------------------
# NCU_CASES="--heads 128 --batch 128 --kv-len 4096 --rows hopper; ..." (mla-bench case options,
# cases separated by ';') profiles the first NCU_LAUNCHES (default 2) launches of the kernels that
# match NCU_KERNELS (default: the decode kernels and the combine) in each case, GPU clocks as they
# are, with the sections that say what limits a kernel: speed of light, compute and memory
# workloads, warp states, launch statistics and occupancy, and NCU_EXTRA's options besides (more
# sections or metrics). One log a case (ncu_<k>.log); the summary counts the launches profiled.
if [[ -n "${NCU_CASES:-}" ]]; then
  NCU="$(find_tool ncu)"
  if [[ -z "$NCU" ]]; then
    record ncu SKIP 0 "ncu not found"
  elif [[ ! -x "$BENCH" ]]; then
    record ncu SKIP 0 "no mla-bench in $BUILD_DIR/tools"
  else
    IFS=';' read -r -a ncu_cases <<<"$NCU_CASES"
    k=0
    for c in "${ncu_cases[@]}"; do
      [[ -n "${c// /}" ]] || continue
      k=$((k + 1))
      t0=$(now)
      rc=0
      log="$OUT_DIR/ncu_$k.log"
      echo "== ncu case $k: mla-bench $c"
      # shellcheck disable=SC2086  # the case and NCU_EXTRA are lists of options
      timeout "${NCU_TIMEOUT_S:-300}" "$NCU" --clock-control none \
        --kernel-name "regex:${NCU_KERNELS:-mla_decode|decode_combine}" \
        --launch-count "${NCU_LAUNCHES:-2}" --section SpeedOfLight --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \
        --section Occupancy ${NCU_EXTRA:-} "$BENCH" --device cuda --warmup 0 --iters 1 $c >"$log" 2>&1 || rc=$?
      grep -E '^  [^ ].*\(|Duration|Compute \(SM\) Throughput|DRAM Throughput|Registers Per' "$log" |
        head -24 || true
      record "ncu $k" "$( ((rc == 0)) && echo PASS || echo FAIL)" $(($(now) - t0)) \
        "exit $rc, $(grep -c '^==PROF== Profiling' "$log" || true) launches, $(basename "$log"): $c"
      if [[ "${NCU_SOURCE:-0}" == 1 ]]; then
        # Warp stall sampling by instruction of one launch of the kernels (after NCU_SOURCE_SKIP
        # launches, default 4: past the warm-up), exported as the source page's CSV and summed up
        # by scripts/ncu_stalls.py (what each top instruction waits on).
        t0=$(now)
        rc=0
        rep="$OUT_DIR/ncu_${k}_source"
        # shellcheck disable=SC2086  # the case is a list of options
        timeout "${NCU_TIMEOUT_S:-300}" "$NCU" --clock-control none \
          --kernel-name "regex:${NCU_KERNELS:-mla_decode|decode_combine}" --launch-skip "${NCU_SOURCE_SKIP:-4}" \
          --launch-count 1 --section SourceCounters --section WarpStateStats -o "$rep" -f \
          "$BENCH" --device cuda --warmup 4 --iters 1 $c >"$rep.log" 2>&1 || rc=$?
        if ((rc == 0)); then
          "$NCU" --import "$rep.ncu-rep" --page source --csv --print-source sass >"$rep.csv" 2>>"$rep.log" || rc=$?
          python3 "$SRC_DIR/scripts/ncu_stalls.py" "$rep.csv" >"$rep.txt" 2>>"$rep.log" || rc=$?
          head -30 "$rep.txt" || true
        fi
        record "ncu $k src" "$( ((rc == 0)) && echo PASS || echo FAIL)" $(($(now) - t0)) \
          "exit $rc, $(basename "$rep").txt"
      fi
    done
  fi
fi

# ---- 5. summary: printed by the EXIT trap ----------------------------------------------------
