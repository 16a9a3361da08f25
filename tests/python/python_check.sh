#!/bin/sh
# `import dcp` in a Python job as torchrun launches it: 4 processes save (tests/python/python_job.py),
# 2 load resharded, bit-exact, and the errors come out as dcp's Python exceptions; README.md's
# Python section runs as written at 2 (tests/python/readme_example.py).
# Usage: python_check.sh PYTHON PYTHONPATH WORKDIR. Exit 77 (skipped) without torch.distributed.run.
set -eu
python=$1 pythonpath=$2 work=$3
here=$(cd "$(dirname "$0")" && pwd)
if ! "$python" -c 'import torch.distributed.run' 2>/dev/null; then
  echo "SKIP: $python has no torch.distributed.run"
  exit 77
fi
rm -rf "$work" && mkdir -p "$work"
export PYTHONPATH="$pythonpath${PYTHONPATH:+:$PYTHONPATH}"
port() { "$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# Occurrences, not lines: the processes' lines may run together on one line of the log.
count() { grep -o "$1" "$2" | wc -l; }
# --redirects/--tee 2: see tests/torch/torchrun_check.sh (torch 1.13 on Python 3.11).
run() {
  n=$1
  shift
  timeout -k 10 240 "$python" -m torch.distributed.run --nnodes=1 --nproc_per_node="$n" \
    --master_addr=127.0.0.1 --master_port="$(port)" --redirects 2 --tee 2 "$@"
}
run 4 "$here/python_job.py" save "$work/ckpt"
# torch.distributed.checkpoint through dcp.torch.Writer/Reader (tests/python/torch_plugin_job.py).
run 4 "$here/torch_plugin_job.py" save "$work/plugin" "$work/ckpt" "$here/../fixtures/pytorch-dcp-2.11" |
  tee "$work/plugin-save.log"
want=24
[ -n "${DCP_TEST_S3_ENDPOINT:-}" ] && want=28 && echo "torch plug-in: s3:// at $DCP_TEST_S3_ENDPOINT too"
test "$(count 'bit-exact\|raised AlreadyExistsError\|replaced the checkpoint' "$work/plugin-save.log")" -eq $want
run 2 "$here/torch_plugin_job.py" load "$work/plugin" | tee "$work/plugin-load.log"
test "$(count 'column-sharded at 2 by [a-zA-Z._]*, bit-exact' "$work/plugin-load.log")" -eq 8
test "$(count 'CorruptionError naming the file' "$work/plugin-load.log")" -eq 2
run 2 "$here/python_job.py" load "$work/ckpt" | tee "$work/load.log"
test "$(count 'loaded bit-exact, resharded' "$work/load.log")" -eq 2
test "$(count 'a load of a missing checkpoint raised CollectiveNotFoundError' "$work/load.log")" -eq 2
run 4 "$here/python_job.py" manager+preempt "$work/managed" | tee "$work/manager.log"
test "$(count 'manager restored step 4 from memory, bit-exact' "$work/manager.log")" -eq 4
test "$(count 'incremental step 3 restored bit-exact' "$work/manager.log")" -eq 4
test "$(count 'preempted, step 3 drained in [0-9.]* s ([0-9.]* s of the window left), restored 3, bit-exact' "$work/manager.log")" -eq 4
run 2 "$here/readme_example.py" "$work/readme" >"$work/readme.log" 2>&1 || { cat "$work/readme.log"; exit 1; }
test "$(count 'readme example: rank . of 2 OK' "$work/readme.log")" -eq 2
timeout -k 10 120 "$python" "$here/python_job.py" errors "$work/one" | tee "$work/errors.log"
grep -q 'errors: as named' "$work/errors.log"
# The background-save benchmark runs (tools/python/dcp_python_bench.py; figures: docs/BENCHMARKS.md).
"$python" "$here/../../tools/python/dcp_python_bench.py" --mib 8 --repeats 1 --seconds 0.2 \
  --dir "$work/bench" | grep -q 'compute loop slowdown'
"$python" "$here/../../tools/python/dcp_torch_plugin_bench.py" --mib 4 --repeats 1 \
  --dir "$work/plugin-bench" | grep -c 'dcp.torch/torch' | grep -q 2
echo "python: saved at 4 processes, loaded at 2, bit-exact; torch.distributed.checkpoint through dcp.torch both ways; a manager restored from memory; incremental steps shared a frozen tensor; a SIGTERM drained; errors as dcp's exceptions"
