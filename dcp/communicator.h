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
// Poisoning: a message of another operation or phase (OpenOperation), or a timeout, poisons the
// communicator: every later collective in which this rank must receive fails at once, naming the
// original failure, so no stale message is ever paired with a later operation. The remedy is a
// new communicator. Operations, the broadcast tree and its failure frames, per-level deadlines
// and poison notices: docs/PROTOCOL.md ("Operations", "Broadcast", "Poison notices").
//
// Thread safety: one thread at a time per Communicator object, except Poison(), Stop() and
// poisoned(), which any thread may call (e.g. a shutdown stopping a background saver). Different
// Communicator objects (e.g. one per background saver) may be used concurrently.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dcp {

struct RankFailure;

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
  /// Every rank returns root's message. (In PointToPointCommunicator, along a tree: a rank
  /// whose ancestor fails throws that ancestor's failure, see the header comment.)
  virtual std::string Broadcast(std::string message, int root, std::string_view what) = 0;
  /// Every rank returns every rank's message (index = rank).
  virtual std::vector<std::string> AllGather(std::string message, std::string_view what) = 0;
  virtual void Barrier(std::string_view what) = 0;

  /// Deadline for a peer to answer one collective. Default 30 minutes (a save's write phase
  /// can be long); tests use seconds. A rank that never joins an operation (e.g. only rank 0
  /// calls dcp::Save) costs the others this long, and the error then says so; set it where the
  /// communicator is made (e.g. MpiCommunicator's constructor).
  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }

  /// Start an operation named `name` ("save", "load") on `target` (e.g. the checkpoint's URI):
  /// collective. Rank 0 chooses a fresh id and broadcasts it with its target (phase
  /// "<name>/open"); until EndOperation every message carries the id. A rank that opened another
  /// operation, or the same one on another target (a rank that skipped a save is saving the
  /// next checkpoint while rank 0 saves this one), fails here with a CollectiveError naming both,
  /// and the communicator is poisoned.
  virtual uint64_t OpenOperation(std::string_view name, std::string_view target);
  /// The operation opened last has ended (either way). Never throws.
  virtual void EndOperation() noexcept {}

  /// Make this communicator unusable (see the header comment); the first reason is kept.
  /// Thread-safe, idempotent, never throws. A collective waiting on another thread fails soon
  /// after (within a poll interval) with the poison error.
  void Poison(const std::string& reason) noexcept;
  bool poisoned() const noexcept { return poisoned_.load(std::memory_order_acquire); }
  /// Poison and also refuse every transport call: for a shutdown that must know this
  /// communicator makes no further call into its transport (e.g. before MPI_Finalize). In a
  /// PointToPointCommunicator (MPI, in-process), when Stop returns no transport call is in
  /// progress (it waits for one, which never blocks) and none will start on any thread; a
  /// stopped MpiCommunicator's or NcclCommunicator's destructor makes none either. Same
  /// thread-safety as Poison.
  void Stop(const std::string& reason) noexcept;
  bool stopped() const noexcept { return stopped_.load(std::memory_order_acquire); }
  /// Why it was poisoned ("" when it is not).
  std::string poison_reason() const;
  /// Tell the ranks that would otherwise wait for this one that it takes no part in what
  /// follows: a poison notice (see the header comment) to rank 0 and to this rank's children in
  /// a broadcast tree rooted at rank 0, as a failed OpenOperation sends. For a rank that failed
  /// outside an operation (e.g. a CheckpointManager collective that found the ranks on different
  /// steps) while its peers go on into the next save without it: they fail at once, naming it
  /// and why, instead of at their deadline. Does nothing unless poisoned, on a stopped
  /// communicator, or on a backend without notices (only PointToPointCommunicator has them).
  /// Never throws. Called like a collective: from the thread using the communicator, or while
  /// no thread does.
  void NotifyPeersOfPoison() noexcept;

  /// Why this communicator must not be used from a background thread while the application
  /// uses the same library on its own thread (e.g. MPI without MPI_THREAD_MULTIPLE), or "" when
  /// it may. AsyncCheckpointer refuses a communicator that reports a problem.
  virtual std::string ConcurrentUseProblem() const { return {}; }

  /// Every rank sends messages[r] to rank r and returns what each rank sent it (index = source).
  /// `messages` must hold size() entries (InvalidArgumentError otherwise); any may be empty. The
  /// default runs one Scatter per root (size() collectives); PointToPointCommunicator sends each
  /// message directly. (Declared after the functions above so that their virtual slots stay
  /// where built plugins expect them.)
  virtual std::vector<std::string> AllToAll(std::vector<std::string> messages,
                                            std::string_view what);

  /// One piece of bulk data: `size` bytes at `data`, to or from rank `peer`.
  struct BulkSend {
    int peer = 0;
    const char* data = nullptr;
    size_t size = 0;
  };
  struct BulkReceive {
    int peer = 0;
    char* data = nullptr;
    size_t size = 0;
  };
  /// Bulk data between ranks, with no copy beyond the transport's own where it allows (the
  /// memory tier's files): this rank sends every piece of `sends` and fills every piece of
  /// `receives`. The pieces one rank sends another arrive, in order, in that rank's receives
  /// from it, in order, piece for piece: the two sides must agree on the pieces' sizes
  /// beforehand (e.g. through an AllToAll). Every rank calls it, possibly with nothing.
  /// Buffers must stay valid until it returns, and, when it throws, for as long as the
  /// communicator lives (a transport may still touch them; the communicator is then poisoned).
  /// CollectiveError on a timeout (naming the ranks this one still waits for) or a mismatch.
  /// The default goes through AllToAll (one message per peer: copies); MpiCommunicator sends
  /// and receives each piece directly; InProcessGroup's ranks copy each piece once, straight
  /// from the sender's memory (an AllToAll of addresses, then a barrier). A receiver that
  /// expects more or fewer bytes from a peer than it sent throws CollectiveError naming that
  /// peer. (Declared last, like AllToAll.)
  virtual void ExchangeBytes(const std::vector<BulkSend>& sends,
                             const std::vector<BulkReceive>& receives, std::string_view what);
  /// Whether AllToAll and ExchangeBytes go straight from each rank to each other (not through
  /// size() Scatters): cooperative reads (LoadOptions::read_once) exchange bulk bytes between
  /// ranks only then. Default false; PointToPointCommunicator (MPI, in-process) says true.
  /// (Declared last, like AllToAll.)
  virtual bool ExchangesDirectly() const { return false; }
  /// A new communicator over the same ranks, with this one's timeout, whose messages never
  /// match this one's: collective (every rank calls it, in the same order as this
  /// communicator's other calls). The two may then be used from two threads at once where
  /// ConcurrentUseProblem() is "" (the memory tier replicates on one while the save writes on
  /// the other). nullptr, on every rank alike, where the backend cannot (the default).
  /// MpiCommunicator duplicates its MPI communicator; InProcessGroup's ranks share a new group.
  /// Throws what the backend's collectives throw. (Declared last, like AllToAll.)
  virtual std::unique_ptr<Communicator> Duplicate() { return nullptr; }

 protected:
  /// Throw the poison error (a CollectiveError for `what`, naming this rank and the original
  /// failure) if this communicator is poisoned.
  void ThrowIfPoisoned(std::string_view what) const;
  /// OpenOperation's check of rank 0's target against this rank's (poisons and throws).
  void CheckTarget(std::string_view what, std::string_view roots, std::string_view mine);
  /// Held by a backend around each call into its transport; Stop takes it to set stopped(), so
  /// a transport call that checked stopped() under it completes before Stop returns.
  std::mutex& transport_mutex() const { return transport_mu_; }

 private:
  std::chrono::milliseconds timeout_{std::chrono::minutes(30)};
  std::atomic<bool> poisoned_{false};
  std::atomic<bool> stopped_{false};
  mutable std::mutex transport_mu_;
  mutable std::mutex poison_mu_;
  std::string poison_reason_;
};

/// Collectives built from non-blocking point-to-point messages with polling and deadlines.
/// A backend implements Send and TryReceive only; messages between two ranks must arrive in the
/// order they were sent (MPI's non-overtaking rule on one tag). Each collective call is numbered,
/// and every message carries its number, the operation id and the phase name: a message with an
/// older number is a late one of an abandoned collective and is dropped; one with a newer number,
/// another operation or another phase means the ranks no longer run the same collective, which
/// fails at once and poisons the communicator. Poison notices (see the header comment) travel on
/// a second tag, kNoticeTag. Every transport call is made under transport_mutex() after checking
/// stopped(), so a stopped communicator makes none.
class PointToPointCommunicator : public Communicator {
 public:
  std::vector<std::string> Gather(std::string message, int root, std::string_view what) override;
  std::string Scatter(std::vector<std::string> messages, int root, std::string_view what) override;
  std::string Broadcast(std::string message, int root, std::string_view what) override;
  std::vector<std::string> AllGather(std::string message, std::string_view what) override;
  void Barrier(std::string_view what) override;
  std::vector<std::string> AllToAll(std::vector<std::string> messages,
                                    std::string_view what) override;
  uint64_t OpenOperation(std::string_view name, std::string_view target) override;
  void EndOperation() noexcept override { op_ = 0; }
  bool ExchangesDirectly() const override { return true; }
  friend class Communicator;  // NotifyPeersOfPoison sends this class's notices

  /// Broadcast's extra wait per tree level for deadline `t`: min(t / 10, 1 s). A rank at depth
  /// d >= 1 waits t + (d - 1) * TreeMargin(t) for its parent.
  static std::chrono::milliseconds TreeMargin(std::chrono::milliseconds t);

 protected:
  /// The tag of dcp's frames, and of poison notices.
  static constexpr int kTag = 0;
  static constexpr int kNoticeTag = 1;
  /// Queue `payload` for `dest`; must not block until the receiver reads it.
  virtual void Send(int dest, int tag, std::string payload) = 0;
  /// The same, for a payload sent to several ranks: a backend that can send from one shared
  /// buffer overrides this, so a broadcast holds one copy of its message, not one per rank (the
  /// default copies).
  virtual void SendShared(int dest, int tag, std::shared_ptr<const std::string> payload) {
    Send(dest, tag, *payload);
  }
  /// A message from `source` with `tag` if one has arrived, without blocking.
  virtual std::optional<std::string> TryReceive(int source, int tag) = 0;
  /// How a receiver waits between polls. MailMark is taken before a round of TryReceive calls;
  /// WaitForMail(mark, round) returns when a message may have arrived for this rank since that
  /// mark, or after a short while (a poll also watches deadlines and poison), `round` counting
  /// the idle rounds of this wait. The default polls: a short spin, then sleeps of up to 1 ms.
  /// A transport that can signal arrivals (InProcessGroup) overrides both, so a waiting rank
  /// wakes at once and burns no CPU meanwhile. (Declared last so that the virtual functions
  /// above keep their places.)
  virtual uint64_t MailMark() { return 0; }
  virtual void WaitForMail(uint64_t mark, int& round);

 private:
  struct Frame;
  // The next message from `source` of collective `seq`, or CollectiveError on timeout, poison,
  // a mismatch (which poisons) or a failure notice from `source` (which poisons).
  std::string Receive(int source, uint64_t seq, std::chrono::steady_clock::time_point deadline,
                      std::string_view what);
  // The same, returning the whole frame as received (for forwarding); its payload starts at
  // *payload_at.
  std::string ReceiveFrame(int source, uint64_t seq, std::chrono::steady_clock::time_point deadline,
                           std::string_view what, size_t* payload_at);
  // Checks a frame received from `source` while this rank waits for collective `seq` / `what`:
  // the payload's offset, nullopt for a stale frame, or throws (poisoning) on a mismatch or a
  // failure notice.
  std::optional<size_t> Accept(const std::string& frame, int source, uint64_t seq,
                               std::string_view what);
  [[noreturn]] void FailMismatch(int source, std::string_view what, const std::string& detail);
  [[noreturn]] void FailTimeout(std::string_view what, const std::vector<int>& ranks);
  std::string MakeFrame(uint64_t seq, std::string_view what, std::string_view payload,
                        uint8_t kind) const;
  void SendFrame(int dest, uint64_t seq, std::string_view what, std::string payload);
  // Tell `dests` (a broadcast's children) that collective `seq` failed with `failures`. Best
  // effort, and nothing at all on a stopped communicator.
  void SendFailure(const std::vector<int>& dests, uint64_t seq, std::string_view what,
                   const std::vector<RankFailure>& failures) noexcept;
  // The transport calls, made only while not stopped (under transport_mutex()): false / nullopt
  // on a stopped communicator.
  bool Transmit(int dest, int tag, std::string payload);
  bool TransmitShared(int dest, int tag, const std::shared_ptr<const std::string>& payload);
  std::optional<std::string> Poll(int source, int tag);
  // A frame from `source`: its next data frame, or else its poison notice.
  std::optional<std::string> PollFrameOrNotice(int source);
  // A poisoned rank tells `dests` (those not yet told) why, once (see the header comment).
  // Best effort; nothing on a stopped communicator or one that is not poisoned.
  void AnnouncePoison(const std::vector<int>& dests) noexcept;
  // OpenOperation failed on this rank, or NotifyPeersOfPoison: tell rank 0 and this rank's
  // children in the open tree.
  void AnnounceOpenFailure() noexcept;
  uint64_t NextSeq() { return ++seq_; }
  uint64_t seq_ = 0;
  uint64_t op_ = 0;           // the operation in progress (0: none)
  bool adopting_op_ = false;  // this rank is receiving the id of an operation being opened
  std::vector<bool> told_;    // ranks this (poisoned) rank has sent its poison notice to
  // Set when this rank was poisoned by another rank's failure notice or poison notice: the
  // failures to pass on (naming the rank that really failed) instead of this rank's own,
  // encoded as in a failure frame.
  std::string cause_;
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
