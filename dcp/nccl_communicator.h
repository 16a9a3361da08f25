// NcclCommunicator: dcp's collectives (plans, results, errors) over NCCL, for GPU jobs that
// want control traffic on the GPU fabric. Built when DCP_WITH_NCCL is on (CUDA runtime, NCCL
// and MPI found). MPI stays the default (MpiCommunicator); NCCL is opt-in.
//
//   dcp::InitMpi(&argc, &argv);
//   dcp::NcclCommunicator comm(MPI_COMM_WORLD);   // collective: NCCL id bootstrapped over MPI
//   dcp::Save(state, uri, comm);
//
// Messages are byte strings of any size; they are staged through a pinned host buffer and a
// device buffer on the communicator's own stream and device, both reused across calls.
//
// Deadlines: the communicator is non-blocking NCCL (ncclConfig_t.blocking = 0), and every
// collective polls for completion until timeout(). A peer that does not answer within the
// deadline makes the call throw CollectiveError (code kTimeout for every other rank: NCCL
// cannot tell which peer is missing); the NCCL communicator is then aborted (ncclCommAbort)
// and every later call throws CollectiveError at once. Never a hang, never a process abort.
// NCCL's own errors (a peer that crashed, a network failure) become CollectiveError naming
// every other rank, with NCCL's error text.
//
// Thread safety: one thread at a time. MPI must be initialised before construction; the MPI
// communicator is used only during construction. Each rank needs its own CUDA device (NCCL
// does not allow two ranks of one communicator on the same device).
#pragma once

#include <mpi.h>

#include <chrono>
#include <memory>
#include <string>

#include "dcp/communicator.h"

namespace dcp {

class NcclCommunicator : public Communicator {
 public:
  /// Collective over `bootstrap`. `device` is the CUDA device of this rank; -1 picks the rank's
  /// index among the ranks on its node, modulo the visible devices. UnsupportedError when the
  /// process has no usable CUDA device; CollectiveError when the NCCL communicator cannot be
  /// formed within `init_timeout` (every rank throws).
  explicit NcclCommunicator(MPI_Comm bootstrap = MPI_COMM_WORLD, int device = -1,
                            std::chrono::milliseconds init_timeout = std::chrono::minutes(5));
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override;
  int size() const override;
  /// The CUDA device this rank's NCCL communicator runs on.
  int device() const;

  std::vector<std::string> Gather(std::string message, int root, std::string_view what) override;
  std::string Scatter(std::vector<std::string> messages, int root, std::string_view what) override;
  std::string Broadcast(std::string message, int root, std::string_view what) override;
  std::vector<std::string> AllGather(std::string message, std::string_view what) override;
  void Barrier(std::string_view what) override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// True when this build has NCCL and the process sees at least `ranks_per_node` CUDA devices;
/// otherwise false with the reason in *why (when given).
bool NcclUsable(int ranks_per_node, std::string* why = nullptr);

}  // namespace dcp
