#!/usr/bin/env bash
# Set up a Debian 12 machine for dcp, build it, and run the demo or the tests.
#
#   tools/setup.sh deps     install the Debian packages dcp needs (idempotent; quick when present)
#   tools/setup.sh build    deps + configure + build            (default)
#   tools/setup.sh demo     build + run dcp-demo under mpirun -np 4 (extra args go to dcp-demo)
#   tools/setup.sh test     build + run the whole test suite with ctest (extra args go to ctest)
#                           with a Ceph RADOS Gateway on loopback for the s3:// tests and the S3
#                           benchmark (tests/s3/start_rgw.sh; skipped with the reason if it cannot
#                           start), then: one clang-16 build with ASan+UBSan and libFuzzer coverage
#                           (all but LibTorch, $DCP_BUILD_DIR-clang16) that runs each fuzzer
#                           (metadata, PyTorch input, safetensors headers, safetensors indexes with
#                           their files) for $DCP_FUZZ_SECONDS (default
#                           30) and the unit, fault and MPI tests; the LibTorch adapter's tests
#                           under g++'s ASan+UBSan ($DCP_BUILD_DIR-asan); and the threaded parts
#                           (async save, protocol, communicators, readers, executor) under TSan
#                           ($DCP_BUILD_DIR-tsan, built without the s3:// backend: its s3 tests
#                           must report skipped). Each log line carries the time since the start.
#
# Non-interactive. Needs root (or sudo) only to install missing packages. The build directory is
# $DCP_BUILD_DIR (default: build/ in the repository).
set -euo pipefail

mode=${1:-build}
[ $# -gt 0 ] && shift
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${DCP_BUILD_DIR:-$root/build}
jobs=$(nproc 2>/dev/null || echo 2)

packages=(
  build-essential cmake ninja-build pkg-config
  libprotobuf-dev protobuf-compiler libisal-dev libxxhash-dev libzstd-dev libzip-dev liburing-dev
  libcli11-dev nlohmann-json3-dev catch2
  libopenmpi-dev openmpi-bin
  libtorch-dev libgloo-dev   # LibTorch; Gloo's headers for c10d's ProcessGroupGloo (torchrun jobs)
  pybind11-dev python3-dev   # the Python package `import dcp` (dcp/python)
  clang-16 libclang-rt-16-dev   # the newest compiler Debian 12 packages: a CI stage (ASan, UBSan, libFuzzer)
  python3 python3-numpy python3-torch   # CLI tests: independent safetensors reader, torch.load
  libcurl4-openssl-dev libssl-dev libtinyxml2-dev   # the s3:// backend (libcurl, OpenSSL's SigV4 HMAC/SHA-256, S3's XML)
  radosgw ceph-mon ceph-osd ceph-common uuid-runtime curl   # s3:// tests: a real Ceph RGW on loopback
)

# Each line carries the time since the script started, so a slow CI run shows which stage grew.
log() { printf '[setup %dm%02ds] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*" >&2; }

# Line tables only (-g1): backtraces and sanitizer reports keep file:line, and the build takes
# about a third less time than with full debug info (torch_adapter.cc: 48 s against 81 s).
relwithdebinfo="-O2 -g1 -DNDEBUG"

install_deps() {
  local missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    log "all ${#packages[@]} packages present"
    return
  fi
  log "installing: ${missing[*]}"
  local sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# The tests at -O1: they compile in a third less time, and their run time is the libraries'
# (which keep -O2) and the disk's (DCP_TESTS_OPTIMIZE, tests/CMakeLists.txt).
configure_and_build() {
  if [ ! -f "$build/build.ninja" ]; then
    log "configuring $build"
    cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$relwithdebinfo" -DCMAKE_C_FLAGS_RELWITHDEBINFO="$relwithdebinfo" \
      -DDCP_TESTS_OPTIMIZE=-O1
  fi
  log "building with $jobs jobs"
  cmake --build "$build" -j "$jobs"
}

# The newest CMake Debian 12 can install, bookworm-backports' (3.31), unpacked into a private
# directory (.cache/, ignored by git) so the system's CMake stays as it is. Prints its path, or
# "cmake" (the system's, said on stderr) when the backports cannot be reached.
newest_cmake() {
  local dir="$root/.cache/cmake-backports" list=/etc/apt/sources.list.d/dcp-bookworm-backports.list
  if [ ! -x "$dir/usr/bin/cmake" ]; then
    local tmp
    tmp=$(mktemp -d)
    if { [ -f "$list" ] || echo "deb http://deb.debian.org/debian bookworm-backports main" >"$list"; } &&
      apt-get update -qq -o Dir::Etc::sourcelist="$list" -o Dir::Etc::sourceparts=- \
        -o APT::Get::List-Cleanup=0 >/dev/null 2>&1 &&
      (cd "$tmp" && apt-get download -qq -t bookworm-backports cmake cmake-data >/dev/null 2>&1); then
      mkdir -p "$dir"
      for deb in "$tmp"/*.deb; do dpkg -x "$deb" "$dir"; done
    fi
    rm -rf "$tmp"
  fi
  if [ -x "$dir/usr/bin/cmake" ] && "$dir/usr/bin/cmake" --version >/dev/null 2>&1; then
    echo "$dir/usr/bin/cmake"
  else
    log "bookworm-backports' CMake unavailable: using the system's" >&2
    echo cmake
  fi
}

# Open MPI refuses to run as root unless told, and needs --oversubscribe for more ranks than cores.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1

case "$mode" in
  deps) install_deps ;;
  build) install_deps; configure_and_build ;;
  demo)
    install_deps; configure_and_build
    exec mpirun --oversubscribe -np "${DCP_DEMO_RANKS:-4}" "$build/tools/dcp-demo" "$@"
    ;;
  test)
    install_deps; configure_and_build
    # s3:// against a real server: a single-node Ceph cluster (monitor, one memstore OSD, RADOS
    # Gateway) on loopback for the main test stage and the S3 benchmark, stopped afterwards. If
    # it cannot start, the s3:// tests skip and print why.
    s3dir="$build/s3-rgw"
    "$root/tests/s3/stop_rgw.sh" "$s3dir"
    trap '"$root/tests/s3/stop_rgw.sh" "$s3dir"' EXIT
    if s3env=$(timeout 150 "$root/tests/s3/start_rgw.sh" "$s3dir"); then
      eval "$s3env"
      log "S3 test server (Ceph RGW): $DCP_TEST_S3_ENDPOINT"
    else
      log "the S3 test server did not start (reason above): s3:// tests will be SKIPPED"
    fi
    log "the test suite"
    (cd "$build" && ctest --output-on-failure -j "$jobs" "$@")
    if [ -n "${DCP_TEST_S3_ENDPOINT:-}" ] && [ -x "$build/tools/dcp-s3-bench" ]; then
      log "S3 benchmark: dcp save/load vs raw PUT/GET, same client, same server"
      "$build/tools/dcp-s3-bench" --uri s3://dcp-bench/run --size-mib "${DCP_S3_BENCH_MIB:-128}" \
        --repeats 3 || log "S3 benchmark failed"
    fi
    "$root/tests/s3/stop_rgw.sh" "$s3dir"
    trap - EXIT
    unset DCP_TEST_S3_ENDPOINT AWS_ENDPOINT_URL AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_REGION
    # One clang-16 build with ASan + UBSan and libFuzzer's coverage: the newest compiler and the
    # newest CMake Debian 12 can install (clang-16 with our -Werror flags, bookworm-backports'
    # CMake 3.31), so code that only g++ 12 accepts, or CMake code that only 3.25 accepts, cannot
    # land; the fuzzers; and the unit, fault, MPI and LibTorch adapter tests under the sanitizers
    # (the LibTorch targets compile as C++17 there: dcp_torch_target, CMakeLists.txt). One build
    # does all of it because compiling is most of CI's time, with the tests and tools at -O0 for
    # the same reason (DCP_TESTS_OPTIMIZE, tests/CMakeLists.txt; the libraries keep -O1,
    # which keeps the tests' run time and the fuzzers' speed). (GCC 13 + CMake 4 + LibTorch 2.x
    # are checked on GPU machines, docs/GPU.md.)
    clang16="$build-clang16"
    cmake_new=$(newest_cmake)
    log "clang-16 + ASan + UBSan + fuzzers, with $("$cmake_new" --version | head -1)"
    if [ ! -f "$clang16/build.ninja" ]; then
      log "configuring $clang16 (clang-16, AddressSanitizer + UndefinedBehaviorSanitizer, libFuzzer)"
      CC=clang-16 CXX=clang++-16 "$cmake_new" -S "$root" -B "$clang16" -G Ninja \
        -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
        -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
        -DDCP_SANITIZE=address -DDCP_TESTS_OPTIMIZE=-O0 -DDCP_FUZZ=ON -DDCP_WITH_CUDA=OFF \
        -DDCP_BUILD_BENCHMARKS=OFF
    fi
    "$cmake_new" --build "$clang16" -j "$jobs"
    # Metadata is untrusted input: fuzz its decoding and validation for a bounded time: dcp's
    # metadata, PyTorch DCP input (the restricted unpickler, .metadata, torch.save records), and
    # safetensors headers and indexes, and whole sharded safetensors checkpoints (an index with the
    # files it names), each from its seed corpus. The four run side by side (each is one process
    # on one core); a crash fails the stage after all four reported.
    fuzz_out=$(mktemp -d)
    fuzz_pids=()
    fuzz_targets=(dcp_metadata_fuzz:corpus dcp_torch_metadata_fuzz:torch_corpus
      dcp_safetensors_fuzz:safetensors_corpus dcp_safetensors_index_fuzz:safetensors_index_corpus
      dcp_metadata_v2_fuzz:metadata_v2_corpus)
    log "fuzzing with ${fuzz_targets[*]%%:*} for ${DCP_FUZZ_SECONDS:-30} s, side by side"
    for target in "${fuzz_targets[@]}"; do
      mkdir "$fuzz_out/${target%%:*}"
      cp "$root/tests/fuzz/${target#*:}"/* "$fuzz_out/${target%%:*}"/
      "$clang16/${target%%:*}" -max_total_time="${DCP_FUZZ_SECONDS:-30}" -rss_limit_mb=2048 \
        -print_final_stats=1 "$fuzz_out/${target%%:*}" >"$fuzz_out/${target%%:*}.log" 2>&1 &
      fuzz_pids+=($!)
    done
    fuzz_failed=0
    for i in "${!fuzz_targets[@]}"; do
      name=${fuzz_targets[$i]%%:*}
      wait "${fuzz_pids[$i]}" || fuzz_failed=1
      echo "-- $name"
      grep -E '^(#|Done|stat::number_of_executed_units|==)' "$fuzz_out/$name.log" | tail -4 || true
    done
    if [ "$fuzz_failed" -ne 0 ]; then
      for f in "$fuzz_out"/*.log; do echo "== $f"; tail -60 "$f"; done
      log "a fuzzer found a failure (its report above)"
      exit 1
    fi
    rm -rf "$fuzz_out"
    # Open MPI's and LibTorch's own allocations are reported as leaks at exit; leak checking stays
    # on for the unit tests, off for the MPI and LibTorch ones (LibTorch is not instrumented).
    # Tests labelled "scale" (time bounds at 100,000 ranks or 200,000 tensors: complexity, not
    # memory safety, and a minute each here) run in the main stage only, as does s3_skips_reported (which the TSan build's stage repeats without s3://),
    # and so do the "docs" checks (README code, the library's shape: nothing a sanitizer sees).
    log "clang-16 ASan: unit and fault tests"
    (cd "$clang16" && ASAN_OPTIONS=detect_leaks=1 "${cmake_new%cmake}ctest" --output-on-failure \
      -j "$jobs" -L unit -LE "large|package|scale|docs|torch" -E '^s3_skips_reported$')
    log "clang-16 ASan: the LibTorch adapter's tests"
    (cd "$clang16" && ASAN_OPTIONS=detect_leaks=0 "${cmake_new%cmake}ctest" --output-on-failure \
      -L torch -R '^torch_')
    log "clang-16 ASan: MPI tests"
    # Two at a time, as in the main stage: much of an MPI test's time is waiting (deadlines,
    # timeouts of a rank the test stalls), not computing.
    (cd "$clang16" && ASAN_OPTIONS=detect_leaks=0 "${cmake_new%cmake}ctest" --output-on-failure \
      -j "$jobs" -L mpi)
    # The threaded parts under ThreadSanitizer: core libraries and the unit tests of the threaded
    # parts (DCP_UNIT_TESTS=threaded, tests/CMakeLists.txt says which), all of which run. This build
    # is also the one without the s3:// backend (DCP_WITH_S3 is optional: off where libcurl,
    # OpenSSL or tinyxml2 is missing): it must build, and its s3 tests must report skipped, not
    # passed. The TSan tests below never reach a server (the endpoint is unset by now), so
    # leaving the backend out costs them nothing and saves CI a build.
    tsan="$build-tsan"
    if [ ! -f "$tsan/build.ninja" ]; then
      log "configuring $tsan (ThreadSanitizer, DCP_WITH_S3=OFF)"
      cmake -S "$root" -B "$tsan" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDCP_SANITIZE=thread \
        -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$relwithdebinfo" -DDCP_WITH_S3=OFF -DDCP_UNIT_TESTS=threaded \
        -DDCP_WITH_TORCH=OFF -DDCP_WITH_MPI=OFF -DDCP_WITH_CUDA=OFF -DDCP_BUILD_TOOLS=OFF
    fi
    log "building $tsan"
    cmake --build "$tsan" -j "$jobs" --target dcp_unit_tests dcp_tier_user_check
    cd "$tsan"
    log "without s3://: the s3 tests report skipped"
    ctest --output-on-failure -j "$jobs" -L unit -R 's3|sigv4|xml'
    export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$root/tests/tsan.supp"
    log "TSan: the threaded parts"
    ctest --output-on-failure -j "$jobs" -L unit -LE "large|scale|docs|package" -E 's3|sigv4|xml'
    log "all stages passed"
    ;;
  *) echo "usage: $0 [deps|build|demo|test] [args...]" >&2; exit 2 ;;
esac
