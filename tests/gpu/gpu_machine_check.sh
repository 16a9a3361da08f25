#!/usr/bin/env bash
# The checks that need a GPU machine (Ubuntu 24.04, GCC 13, CMake 4, pip's torch 2.x with CUDA),
# in one pass: build what they need, run the gpu/nccl tests, the LibTorch 2.x adapter tests, a
# 3-rank torchdcp:// save read back by torch 2.x's own DCP loader, dcp-gpu-bench, the memory
# tier's bench with CUDA tensors and the training demo's stop/resume check.
#   tests/gpu/gpu_machine_check.sh DEBS_DIR LOG_DIR [BENCH_MIB]
# DEBS_DIR holds Debian 12 .debs of what such a machine lacks (docs/GPU.md lists them); each is
# unpacked into a private prefix only when the machine has no such library. Every step runs even
# when an earlier one failed; the summary at the end lists each step's exit status. Warnings are
# not errors here (DCP_WERROR=OFF) so that one new GCC 13 warning cannot hide every other result:
# the log's "warning:" lines are counted and printed instead.
set -uo pipefail
debs=${1:?DEBS_DIR}
logs=${2:?LOG_DIR}
bench_mib=${3:-2048}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
mkdir -p "$logs"
summary=()
step() {  # step NAME COMMAND...: run, log to LOG_DIR/NAME.log, remember the status
  local name=$1 t0=$SECONDS rc
  shift
  echo "=== $name"
  "$@" >>"$logs/$name.log" 2>&1
  rc=$?
  tail -n 25 "$logs/$name.log"
  summary+=("$name: rc=$rc ($((SECONDS - t0)) s)")
}

echo "=== machine"
nvidia-smi -L 2>&1 | head -2
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
gcc --version | head -1
cmake --version | head -1
command -v mpirun >/dev/null && mpirun --version 2>&1 | head -1 || echo "no mpirun"
command -v protoc >/dev/null && protoc --version || echo "no protoc"

prefix=/tmp/dcpdeps
mkdir -p "$prefix"
for f in "$debs"/*.deb; do
  case $(basename "$f") in
    libprotobuf* | libprotoc* | protobuf-compiler*) command -v protoc >/dev/null && continue ;;
    libzstd-dev*) [ -f /usr/include/zstd.h ] && continue ;;
    libxxhash*) [ -f /usr/include/xxhash.h ] && continue ;;
  esac
  dpkg -x "$f" "$prefix"
done
sed -i "s|^prefix=/usr|prefix=$prefix/usr|" "$prefix"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc
export PATH=$prefix/usr/bin:$PATH
export CMAKE_PREFIX_PATH=$prefix/usr:$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
export PKG_CONFIG_PATH=$prefix/usr/lib/x86_64-linux-gnu/pkgconfig CPATH=$prefix/usr/include
export LIBRARY_PATH=$prefix/usr/lib/x86_64-linux-gnu LD_LIBRARY_PATH=$prefix/usr/lib/x86_64-linux-gnu
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1

build=/tmp/dcp-gpu-build
step build cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DDCP_WERROR=OFF -DDCP_BUILD_EXAMPLES=OFF
step build ninja -C "$build" -k 0 dcp-cli dcp-gpu-bench dcp_gpu_tests dcp_nccl_tests dcp_mpi_tests \
  dcp_torch_tests dcp-train dcp-tier-bench
echo "warnings in dcp's code under $(gcc --version | head -1):"
grep -E "^$root/.*warning:" "$logs/build.log" | sort -u | head -40
echo "($(grep -cE "^$root/.*warning:" "$logs/build.log") warning lines)"

rm -rf /tmp/dcp-mpi-torchdcp
step mpi_torchdcp bash -c "cd $build && DCP_TEST_TORCHDCP_OUT=/tmp/dcp-mpi-torchdcp \
  ctest --output-on-failure --timeout 120 -R '^mpi_np3_torchdcp$'"
step torch2_load timeout 180 python3 "$root/tests/gpu/torch2_load_check.py" --dcp "$build/tools/dcp" \
  --fixtures "$root/tests/fixtures/pytorch-dcp-2.11" --workdir /tmp/dcp-torch2 \
  --extra dist4_dtensor=/tmp/dcp-mpi-torchdcp
step gpu_tests bash -c "cd $build && ctest --output-on-failure --timeout 150 -R '^gpu$'"
step gpu_bench timeout 200 "$build/tools/dcp-gpu-bench" --size-mib "$bench_mib" --repeats 3
# The memory tier with CUDA tensors (4 ranks on device 0, as 2 nodes): its save against a copy
# from the device + an exchange, overlapped and not, and its restores into CUDA tensors.
step tier_bench_cuda timeout 240 mpirun -np 4 "$build/tools/dcp-tier-bench" --cuda --mib 512 \
  --ranks-per-node 2 --repeats 3 --disk /tmp/dcp-tier-bench --no-preempt
step torch_adapter bash -c "cd $build && ctest --output-on-failure --timeout 120 -R '^torch_adapter$'"
step train_resume bash -c "cd $build && ctest --output-on-failure --timeout 240 -R '^train_resume$'"
step nccl_tests bash -c "cd $build && ctest --output-on-failure --timeout 120 -R '^nccl_np'"

echo "=== summary"
printf '%s\n' "${summary[@]}"
