// Shared state of the MPI test binary: one communicator for the whole run, and a checkpoint
// directory that every rank agrees on.
#pragma once

#include <string>

#include "dcp/mpi_communicator.h"

namespace dcp::testing {

/// The job-wide communicator (created in main after MPI_Init_thread).
MpiCommunicator& Comm();
/// Replace it with a new one (collective over MPI_COMM_WORLD): after a test that poisons it
/// (a timeout), as an application would.
void ResetComm();

/// A fresh directory path shared by all ranks (rank 0 picks it; collective). Removed on all
/// ranks' agreement by RemoveSharedDir.
std::string SharedDir(const std::string& tag);
void RemoveSharedDir(const std::string& path);

}  // namespace dcp::testing
