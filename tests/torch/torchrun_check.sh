#!/bin/sh
# torchrun (torch.distributed.run) starts 4 processes of a LibTorch program that links no MPI:
# they save over c10d's Gloo (ConnectTorchrun, dcp/torch_adapter.h); then 2 processes load it resharded, bit-exact.
# Usage: torchrun_check.sh PYTHON PROGRAM WORKDIR. Exit 77 (skipped) without torch.distributed.run.
set -eu
python=$1 program=$2 work=$3
if ! "$python" -c 'import torch.distributed.run' 2>/dev/null; then
  echo "SKIP: $python has no torch.distributed.run"
  exit 77
fi
if ldd "$program" | grep -i 'libmpi'; then
  echo "FAIL: $program links MPI" >&2
  exit 1
fi
rm -rf "$work" && mkdir -p "$work"
port() { "$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# --redirects/--tee 2 (stderr to a log file, and to the console too): torch 1.13's torchrun
# parses their default, 0, as None on Python 3.11 (an IntFlag change) and fails before starting
# anything; 2 parses on every version.
run() {
  n=$1
  shift
  timeout -k 10 180 "$python" -m torch.distributed.run --nnodes=1 --nproc_per_node="$n" \
    --master_addr=127.0.0.1 --master_port="$(port)" --redirects 2 --tee 2 \
    --no_python "$program" "$@"
}
run 4 save "$work/ckpt"
run 2 load "$work/ckpt" | tee "$work/load.log"
test "$(grep -c 'loaded bit-exact, resharded' "$work/load.log")" -eq 2
echo "torchrun: saved at 4 processes, loaded at 2, bit-exact"
