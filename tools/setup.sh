#!/usr/bin/env bash
# Set up a Debian 12 machine for dcp, build it, and run the demo or the tests.
#
#   tools/setup.sh deps     install the Debian packages dcp needs (idempotent; quick when present)
#   tools/setup.sh build    deps + configure + build            (default)
#   tools/setup.sh demo     build + run dcp-demo under mpirun -np 4 (extra args go to dcp-demo)
#   tools/setup.sh test     build + run the whole test suite with ctest (extra args go to ctest)
#                           with a Ceph RADOS Gateway on loopback for the s3:// tests and the S3
#                           benchmark (tests/s3/start_rgw.sh; skipped with the reason if it cannot
#                           start), then: a clang-16 build (all but LibTorch) and its unit tests
#                           ($DCP_BUILD_DIR-clang16), the unit, fault and MPI tests under ASan+UBSan
#                           ($DCP_BUILD_DIR-asan),
#                           the threaded parts (async save, protocol, communicators, readers, executor) under TSan
#                           ($DCP_BUILD_DIR-tsan), and each fuzzer (metadata, PyTorch metadata, safetensors) for $DCP_FUZZ_SECONDS
#                           (default 40) over tests/fuzz/corpus ($DCP_BUILD_DIR-fuzz, clang)
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
  libprotobuf-dev protobuf-compiler libisal-dev libzstd-dev libzip-dev liburing-dev
  libcli11-dev nlohmann-json3-dev catch2
  libopenmpi-dev openmpi-bin
  libtorch-dev
  clang libclang-rt-14-dev clang-16   # clang-16: the newest compiler Debian 12 packages (a CI stage)
  python3 python3-numpy python3-torch   # CLI tests: independent safetensors reader, torch.load
  libcurl4-openssl-dev libssl-dev libtinyxml2-dev   # the s3:// backend (libcurl, OpenSSL's SigV4 HMAC/SHA-256, S3's XML)
  radosgw ceph-mon ceph-osd ceph-common uuid-runtime curl   # s3:// tests: a real Ceph RGW on loopback
)

log() { printf '[setup] %s\n' "$*" >&2; }

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

configure_and_build() {
  if [ ! -f "$build/build.ninja" ]; then
    log "configuring $build"
    cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
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
    (cd "$build" && ctest --output-on-failure -j "$jobs" "$@")
    if [ -n "${DCP_TEST_S3_ENDPOINT:-}" ] && [ -x "$build/tools/dcp-s3-bench" ]; then
      log "S3 benchmark: dcp save/load vs raw PUT/GET, same client, same server"
      "$build/tools/dcp-s3-bench" --uri s3://dcp-bench/run --size-mib "${DCP_S3_BENCH_MIB:-256}" \
        --repeats 3 || log "S3 benchmark failed"
    fi
    "$root/tests/s3/stop_rgw.sh" "$s3dir"
    trap - EXIT
    unset DCP_TEST_S3_ENDPOINT AWS_ENDPOINT_URL AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_REGION
    # The newest compiler and the newest CMake Debian 12 can install, clang-16 with our -Werror
    # flags and bookworm-backports' CMake 3.31: code that only g++ 12 accepts, or CMake code
    # that only 3.25 accepts, cannot land. (GCC 13 + CMake 4 + LibTorch 2.x are checked on GPU
    # machines, docs/GPU.md.) Everything but the LibTorch adapter is built (Debian's LibTorch
    # 1.13 headers themselves do not compile with clang-16: c10::IValue is incomplete in
    # ivalue_inl.h), and the unit tests run once more. -O1 without debug info: clang's warnings
    # come from its front end, and the stage builds in about half the time.
    clang16="$build-clang16"
    cmake_new=$(newest_cmake)
    log "clang-16 stage with $("$cmake_new" --version | head -1)"
    if [ ! -f "$clang16/build.ninja" ]; then
      log "configuring $clang16 (clang-16)"
      CC=clang-16 CXX=clang++-16 "$cmake_new" -S "$root" -B "$clang16" -G Ninja \
        -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -DNDEBUG" \
        -DDCP_WITH_CUDA=OFF -DDCP_WITH_TORCH=OFF
    fi
    "$cmake_new" --build "$clang16" -j "$jobs"
    (cd "$clang16" && "${cmake_new%cmake}ctest" --output-on-failure -j "$jobs" -L unit \
      -LE "large|package")
    # Metadata is untrusted input: fuzz its decoding and validation for a bounded time.
    fuzz="$build-fuzz"
    if [ ! -f "$fuzz/build.ninja" ]; then
      log "configuring $fuzz (libFuzzer, clang)"
      CC=clang CXX=clang++ cmake -S "$root" -B "$fuzz" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DDCP_FUZZ=ON -DDCP_SANITIZE=address -DDCP_WITH_TORCH=OFF -DDCP_WITH_MPI=OFF \
        -DDCP_WITH_CUDA=OFF -DDCP_BUILD_TOOLS=OFF -DDCP_BUILD_TESTS=OFF
    fi
    cmake --build "$fuzz" -j "$jobs" --target dcp_metadata_fuzz dcp_torch_metadata_fuzz \
      dcp_safetensors_fuzz
    # dcp's metadata, then PyTorch DCP input (the restricted unpickler, .metadata, torch.save
    # records), then safetensors headers and indexes, each from its seed corpus.
    for target in dcp_metadata_fuzz:corpus dcp_torch_metadata_fuzz:torch_corpus \
      dcp_safetensors_fuzz:safetensors_corpus; do
      corpus=$(mktemp -d)
      cp "$root/tests/fuzz/${target#*:}"/* "$corpus"/
      log "fuzzing with ${target%%:*} for ${DCP_FUZZ_SECONDS:-40} s"
      "$fuzz/${target%%:*}" -max_total_time="${DCP_FUZZ_SECONDS:-40}" -rss_limit_mb=2048 \
        -print_final_stats=1 "$corpus" 2>&1 |
        grep -E '^(#|Done|stat::number_of_executed_units|==)' | tail -4
      rm -rf "$corpus"
    done
    # ASan + UBSan over the unit, fault, LibTorch adapter and MPI tests. LibTorch itself is not
    # instrumented; the adapter and its tests are (the use-after-free scenarios of
    # tests/torch/torch_binding_test.cc).
    asan="$build-asan"
    if [ ! -f "$asan/build.ninja" ]; then
      log "configuring $asan (AddressSanitizer + UndefinedBehaviorSanitizer)"
      cmake -S "$root" -B "$asan" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDCP_SANITIZE=address \
        -DDCP_WITH_CUDA=OFF -DDCP_BUILD_TOOLS=OFF
    fi
    cmake --build "$asan" -j "$jobs"
    # Open MPI's and LibTorch's own allocations are reported as leaks at exit; leak checking stays
    # on for the unit tests, off for the MPI and LibTorch ones.
    (cd "$asan" && ASAN_OPTIONS=detect_leaks=1 ctest --output-on-failure -j "$jobs" -L unit -LE torch -E package_consumer)
    (cd "$asan" && ASAN_OPTIONS=detect_leaks=0 ctest --output-on-failure -L torch -LE mpi)
    (cd "$asan" && ASAN_OPTIONS=detect_leaks=0 ctest --output-on-failure -L mpi)
    # The threaded parts under ThreadSanitizer: core libraries and unit tests only.
    tsan="$build-tsan"
    if [ ! -f "$tsan/build.ninja" ]; then
      log "configuring $tsan (ThreadSanitizer)"
      cmake -S "$root" -B "$tsan" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDCP_SANITIZE=thread \
        -DDCP_WITH_TORCH=OFF -DDCP_WITH_MPI=OFF -DDCP_WITH_CUDA=OFF -DDCP_BUILD_TOOLS=OFF
    fi
    cmake --build "$tsan" -j "$jobs" --target dcp_unit_tests
    cd "$tsan"
    export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$root/tests/tsan.supp"
    exec ctest --output-on-failure -j "$jobs" -R '^(fault:)?(async|manager|checkpoint io|protocol|communicator|conformance|device|reader|read-once|compact plan|failfast|executor):'
    ;;
  *) echo "usage: $0 [deps|build|demo|test] [args...]" >&2; exit 2 ;;
esac
