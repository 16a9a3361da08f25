#!/bin/sh
# The same 4-process save under torchrun (c10d Gloo, no MPI) and under mpirun, alternately,
# ROUNDS times; prints each side's median and their ratio (torchrun / mpirun; issue 47 asks
# <= 1.05). Usage: torchrun_bench.sh BUILD_DIR [MIB_PER_RANK] [ROUNDS] [DIR]
set -eu
build=$1 mib=${2:-64} rounds=${3:-3} dir=${4:-/tmp/dcp-torchrun-bench}
python=/usr/bin/python3
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
port() { "$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
tr="" mp=""
i=0
while [ $i -lt "$rounds" ]; do
  t=$("$python" -m torch.distributed.run --nnodes=1 --nproc_per_node=4 --master_addr=127.0.0.1 \
      --master_port="$(port)" --redirects 2 --tee 2 --no_python \
      "$build/tests/dcp_torchrun_check" bench "$dir" "$mib" 5 2>/dev/null | awk '/save_s/ {print $2}')
  m=$(mpirun --oversubscribe -np 4 "$build/tests/dcp_torchrun_check_mpi" bench "$dir" "$mib" 5 \
      2>/dev/null | awk '/save_s/ {print $2}')
  echo "round $((i + 1)): torchrun $t s, mpirun $m s"
  tr="$tr $t" mp="$mp $m"
  i=$((i + 1))
done
rm -rf "$dir"
median() { printf '%s\n' $1 | sort -g | awk '{a[NR]=$1} END {print a[int((NR + 1) / 2)]}'; }
t=$(median "$tr") m=$(median "$mp")
awk -v t="$t" -v m="$m" -v mib="$mib" 'BEGIN {
  printf "save of %d MiB per rank, 4 ranks: torchrun %.3f s, mpirun %.3f s, ratio %.2fx\n", mib, t, m, t / m }'
