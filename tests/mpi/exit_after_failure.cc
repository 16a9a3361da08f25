// A rank that catches a CollectiveError and returns from main must not hang the job in
// MPI_Finalize (InitMpi's exit hook) while a peer waits for it: the job ends non-zero within
// seconds (issue 43). Run under mpirun with 2 or more ranks; the mode is the first argument:
//   dcp      rank 0 waits in a dcp collective (10 min deadline) that rank 1 never joins
//   mpi      rank 0 waits in the application's own MPI_Barrier, which rank 1 never joins
//   recover  every rank makes a fresh MpiCommunicator after the failure and goes on: the job
//            met again, so it finalises normally and exits 0
// In the first two, rank 1 received a message of another collective (a mismatch: its
// communicator is poisoned), caught the error and returned 0. Before, its exit hook called
// MPI_Finalize, which waited for rank 0 for ever; now the hook ends the job with MPI_Abort.
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include "dcp/mpi_communicator.h"
#include "dcp/proto/error.h"

int main(int argc, char** argv) {
  dcp::InitMpi(&argc, &argv);
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "dcp" && mode != "mpi" && mode != "recover") {
    std::fprintf(stderr, "usage: %s dcp|mpi|recover (under mpirun, 2 or more ranks)\n", argv[0]);
    return 2;
  }
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size < 2) {
    std::fprintf(stderr, "needs 2 or more ranks\n");
    return 2;
  }
  {
    dcp::MpiCommunicator comm(MPI_COMM_WORLD, std::chrono::minutes(10));
    // Rank 0 broadcasts step 1 while rank 1 expects step 2 (it skipped one): rank 1 fails at
    // once with a CollectiveError naming both, and its communicator is poisoned.
    bool caught = false;
    try {
      comm.Broadcast(rank == 0 ? "hello" : "", 0, rank == 1 ? "test/step=2" : "test/step=1");
    } catch (const dcp::CollectiveError& e) {
      caught = true;
      std::fprintf(stderr, "rank %d: caught: %s\n", rank, e.what());
    }
    if ((rank == 1) != caught) {
      std::fprintf(stderr, "rank %d: FAILED: expected the mismatch on rank 1 only\n", rank);
      return 3;
    }
    if (mode == "recover") {
      // The remedy dcp documents: a fresh communicator, made collectively. Its construction
      // proves that every rank got past the failure, so exiting normally is safe.
      dcp::MpiCommunicator fresh(MPI_COMM_WORLD, std::chrono::seconds(60));
      fresh.Barrier("test/recovered");
      if (rank == 0) std::printf("exit after failure: recovered\n");
      return 0;
    }
    if (rank == 1) return 0;  // gives up: the exit hook runs
    if (mode == "dcp") {
      try {
        comm.Gather({}, 0, "test/wait");  // rank 1 never joins: 10 minutes
      } catch (const dcp::CollectiveError& e) {
        std::fprintf(stderr, "rank %d: the wait ended: %s\n", rank, e.what());
      }
    } else {
      MPI_Barrier(MPI_COMM_WORLD);  // rank 1 never joins: for ever
    }
  }
  std::fprintf(stderr, "rank %d: FAILED: the job was not ended while this rank waited\n", rank);
  return 0;
}
