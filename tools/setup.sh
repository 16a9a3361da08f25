#!/usr/bin/env bash
# Set up a Debian 12 machine for dcp, build it, and run the demo or the tests.
#
#   tools/setup.sh deps     install the Debian packages dcp needs (idempotent; quick when present)
#   tools/setup.sh build    deps + configure + build            (default)
#   tools/setup.sh demo     build + run dcp-demo under mpirun -np 4 (extra args go to dcp-demo)
#   tools/setup.sh test     build + run the whole test suite with ctest (extra args go to ctest)
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
  libprotobuf-dev protobuf-compiler libisal-dev libzstd-dev liburing-dev
  libcli11-dev nlohmann-json3-dev catch2
  libopenmpi-dev openmpi-bin
  libtorch-dev
  python3 python3-numpy python3-torch   # CLI tests: independent safetensors reader, torch.load
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
    cd "$build"
    exec ctest --output-on-failure -j "$jobs" "$@"
    ;;
  *) echo "usage: $0 [deps|build|demo|test] [args...]" >&2; exit 2 ;;
esac
