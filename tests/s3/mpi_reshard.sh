#!/usr/bin/env bash
# ctest s3_mpi_reshard: a 4-rank save then a resharding 3-rank load through s3:// on the test
# server, as two MPI jobs (the second sees only what the first left in the object store).
#   mpi_reshard.sh MPIEXEC DCP_MPI_TESTS
# Exits 77 (ctest: skipped) with the reason when no server is configured.
set -euo pipefail
mpiexec=$1 tests=$2
if [ -z "${DCP_TEST_S3_ENDPOINT:-}" ]; then
  echo "SKIPPED: no S3 test server (DCP_TEST_S3_ENDPOINT is not set; tools/setup.sh test starts one)"
  exit 77
fi
export AWS_ENDPOINT_URL=$DCP_TEST_S3_ENDPOINT
export DCP_S3_MPI_URI="s3://dcp-test/mpi-reshard-$$-$RANDOM"
echo "checkpoint: $DCP_S3_MPI_URI"
"$mpiexec" --oversubscribe -np 4 "$tests" "[.s3save]" --use-colour no
"$mpiexec" --oversubscribe -np 3 "$tests" "[.s3load]" --use-colour no
