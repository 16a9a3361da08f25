// Communicator: how ranks exchange control messages (plans, results, errors) during save and load.
//
// All collectives are called by every rank of the group in the same order (SPMD). Each has a
// deadline: a rank that does not answer within timeout() becomes a CollectiveError naming it
// (failures with code kTimeout), never a hang. Messages are byte strings of any size.
//
// Backends: LocalCommunicator (one process, no MPI), InProcessGroup (N ranks as threads of one
// process: tests and single-node tools), MpiCommunicator (dcp/mpi_communicator.h) on a private
// duplicate of the job's MPI communicator, so dcp traffic never mixes with the application's.
//
// Thread safety: one thread at a time per Communicator object. Different Communicator objects
// (e.g. one per background saver) may be used concurrently.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dcp {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  /// Root receives every rank's message (index = rank); other ranks receive an empty vector.
  virtual std::vector<std::string> Gather(std::string message, int root, std::string_view what) = 0;
  /// Root sends messages[r] to rank r; every rank returns its own. Non-roots pass {}.
  virtual std::string Scatter(std::vector<std::string> messages, int root,
                              std::string_view what) = 0;
  /// Every rank returns root's message.
  virtual std::string Broadcast(std::string message, int root, std::string_view what) = 0;
  /// Every rank returns every rank's message (index = rank).
  virtual std::vector<std::string> AllGather(std::string message, std::string_view what) = 0;
  virtual void Barrier(std::string_view what) = 0;

  /// Deadline for a peer to answer one collective. Default 30 minutes (a save's write phase
  /// can be long); tests use seconds.
  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }

 private:
  std::chrono::milliseconds timeout_{std::chrono::minutes(30)};
};

/// Collectives built from non-blocking point-to-point messages with polling and deadlines.
/// A backend implements Send and TryReceive only. Each collective call is numbered; messages
/// carry the number, so a late message from an abandoned collective is recognised and dropped.
class PointToPointCommunicator : public Communicator {
 public:
  std::vector<std::string> Gather(std::string message, int root, std::string_view what) override;
  std::string Scatter(std::vector<std::string> messages, int root, std::string_view what) override;
  std::string Broadcast(std::string message, int root, std::string_view what) override;
  std::vector<std::string> AllGather(std::string message, std::string_view what) override;
  void Barrier(std::string_view what) override;

 protected:
  /// Queue `payload` for `dest`; must not block until the receiver reads it.
  virtual void Send(int dest, int tag, std::string payload) = 0;
  /// A message from `source` with `tag` if one has arrived, without blocking.
  virtual std::optional<std::string> TryReceive(int source, int tag) = 0;
  /// Largest tag value the backend accepts (tags cycle below it).
  virtual int max_tag() const { return 1 << 20; }

 private:
  std::string Receive(int source, uint64_t seq, std::chrono::steady_clock::time_point deadline,
                      std::string_view what);
  uint64_t NextSeq() { return ++seq_; }
  int TagFor(uint64_t seq) const {
    return static_cast<int>(seq % static_cast<uint64_t>(max_tag()));
  }
  uint64_t seq_ = 0;
};

/// The trivial group of one rank.
class LocalCommunicator : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::vector<std::string> Gather(std::string m, int, std::string_view) override {
    return {std::move(m)};
  }
  std::string Scatter(std::vector<std::string> m, int, std::string_view) override;
  std::string Broadcast(std::string m, int, std::string_view) override { return m; }
  std::vector<std::string> AllGather(std::string m, std::string_view) override {
    return {std::move(m)};
  }
  void Barrier(std::string_view) override {}
};

/// N ranks in one process, each used from its own thread. Create the group, then hand
/// communicator(r) to the thread playing rank r. The group must outlive its communicators' use.
class InProcessGroup {
 public:
  explicit InProcessGroup(int size);
  ~InProcessGroup();
  int size() const;
  Communicator& communicator(int rank);
  /// Hand over rank `rank`'s communicator (e.g. to an AsyncCheckpointer); it stays usable after
  /// the group is destroyed. communicator(rank) must not be used afterwards.
  std::unique_ptr<Communicator> Release(int rank);

  struct State;  // shared mailboxes (defined in communicator.cc)

 private:
  std::shared_ptr<State> state_;
  std::vector<std::unique_ptr<Communicator>> comms_;
};

}  // namespace dcp
