// MpiCommunicator: dcp's collectives over MPI, on a private duplicate of the job's communicator
// (MPI_Comm_dup), so dcp messages never match the application's receives. Built when
// DCP_WITH_MPI is on; include <mpi.h> users only.
//
// Collectives use MPI_Isend and MPI_Improbe/MPI_Mrecv polling, so a peer that never answers
// becomes a CollectiveError after timeout() instead of a hang; a collective never calls
// MPI_Abort (only InitMpi's exit hook may, see there).
// MPI must be initialised before construction and finalised after destruction, unless the
// communicator was stopped (Communicator::Stop, as AsyncCheckpointer::Close does): a stopped
// MpiCommunicator makes no MPI call at all, its destructor included (its pending sends and its
// MPI communicator are then left to MPI_Finalize), so it may be destroyed after MPI_Finalize. A
// background saver using its own MpiCommunicator concurrently with the training thread needs
// MPI_THREAD_MULTIPLE (see InitMpi).
#pragma once

#include <mpi.h>

#include <chrono>
#include <list>
#include <memory>
#include <string>

#include "dcp/communicator.h"

namespace dcp {

class MpiCommunicator : public PointToPointCommunicator {
 public:
  /// Duplicate `comm` (collective over `comm`). `timeout` is the deadline of every collective
  /// (timeout(): how long a rank waits for a peer before the save or load fails naming it; a
  /// save's write phase must fit in it; set_timeout changes it later), and of the construction
  /// itself: a rank that does not join within it makes the constructor throw CollectiveError
  /// instead of hanging.
  explicit MpiCommunicator(MPI_Comm comm = MPI_COMM_WORLD,
                           std::chrono::milliseconds timeout = std::chrono::minutes(30));
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  MPI_Comm comm() const { return comm_; }
  /// Non-empty when MPI was initialised below MPI_THREAD_MULTIPLE (see Communicator).
  std::string ConcurrentUseProblem() const override;
  /// Each piece straight from and into the caller's buffers (MPI_Isend / MPI_Irecv on a tag of
  /// its own, pieces over 1 GiB split), polled until done or timeout().
  void ExchangeBytes(const std::vector<BulkSend>& sends, const std::vector<BulkReceive>& receives,
                     std::string_view what) override;
  /// Another MpiCommunicator over a duplicate of this one's MPI communicator (collective, as
  /// the constructor); CollectiveError when this one is poisoned.
  std::unique_ptr<Communicator> Duplicate() override;

 protected:
  void Send(int dest, int tag, std::string payload) override;
  void SendShared(int dest, int tag, std::shared_ptr<const std::string> payload) override;
  std::optional<std::string> TryReceive(int source, int tag) override;

 private:
  void ReapCompletedSends();
  struct PendingSend;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  int thread_level_ = 0;  // what MPI provides (MPI_Query_thread)
  std::list<std::unique_ptr<PendingSend>> pending_;
};

/// Initialise MPI if it is not already, asking for MPI_THREAD_MULTIPLE (needed by async save).
/// Returns the thread level provided. Idempotent. If it initialised MPI, a hook at process exit
/// (after main returns, or exit()) finalises it unless the program did, except after a failure
/// the job did not get past: when an MpiCommunicator of this process was poisoned (a timeout, a
/// mismatch, a peer's poison notice; not stopped by a shutdown such as AsyncCheckpointer::Close)
/// and no MpiCommunicator was made after it, MPI_Finalize would wait for peers that may be
/// waiting for this rank in a collective, for ever. The hook then prints one line on stderr
/// ("dcp: rank N: ending the MPI job (MPI_Abort, exit code 1) ...", with the poison reason) and
/// calls MPI_Abort(MPI_COMM_WORLD, 1), so the job ends at once, non-zero, on every rank. A job
/// that went on with fresh communicators (CheckpointManager::ReplaceCommunicator, a new
/// MpiCommunicator: made collectively, they show that the ranks met again) finalises as usual.
int InitMpi(int* argc, char*** argv);

}  // namespace dcp
