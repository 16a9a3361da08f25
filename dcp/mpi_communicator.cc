#include "dcp/mpi_communicator.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "dcp/proto/error.h"

namespace dcp {

namespace {
void Check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    throw CollectiveError(
        what, {{-1, ErrorCode::kIo, std::string(what) + ": " + std::string(msg, len), false}});
  }
}

// Every MpiCommunicator of the process, for InitMpi's exit hook: was one poisoned by a failure
// (a timeout, a mismatch, a peer's notice) that the job did not get past? A communicator made
// (collectively: MPI_Comm_idup completed on every rank) after a poisoning shows that the ranks
// met again, so it settles the failures before it: the job went on, as dcp documents (fresh
// communicators). A stopped communicator does not count: a shutdown (AsyncCheckpointer::Close)
// stopped it and reported its unfinished save to the application.
struct FailureLedger {
  std::mutex mu;
  std::map<const MpiCommunicator*, bool> live;  // -> settled
  std::string unsettled;  // why a communicator destroyed unsettled was poisoned ("": none)
};

FailureLedger& Ledger() {
  static auto* ledger = new FailureLedger;  // never destroyed: the exit hook reads it
  return *ledger;
}

bool Unsettled(const MpiCommunicator& c) { return c.poisoned() && !c.stopped(); }

constexpr int kExitCodeAfterFailure = 1;  // mpirun's exit code when the exit hook aborts

// Why the process must not wait for its peers in MPI_Finalize ("" when it may).
std::string UnsettledFailure() {
  FailureLedger& l = Ledger();
  std::lock_guard<std::mutex> lock(l.mu);
  for (const auto& [c, settled] : l.live) {
    if (!settled && Unsettled(*c)) return c->poison_reason();
  }
  return l.unsettled;
}

}  // namespace

struct MpiCommunicator::PendingSend {
  std::string buffer;
  std::shared_ptr<const std::string> shared;  // or a buffer shared by several sends
  MPI_Request request = MPI_REQUEST_NULL;
};

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::chrono::milliseconds timeout) {
  set_timeout(timeout);
  // MPI_Comm_dup blocks until every rank joins; the non-blocking form lets a rank that never
  // joins become an error instead of a hang.
  MPI_Request request = MPI_REQUEST_NULL;
  Check(MPI_Comm_idup(comm, &comm_, &request), "MPI_Comm_idup");
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (int done = 0;;) {
    Check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test (MPI_Comm_idup)");
    if (done) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      // The request cannot be cancelled; it is left to MPI (the job is broken anyway).
      int me = -1;
      MPI_Comm_rank(comm, &me);
      throw CollectiveError(
          "MPI_Comm_idup",
          {{me, ErrorCode::kTimeout,
            "not every rank joined the creation of dcp's communicator (MPI_Comm_idup) within " +
                std::to_string(timeout.count()) + " ms (seen by rank " + std::to_string(me) +
                "): every rank must construct an MpiCommunicator at the same point",
            true}});
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  // Errors must come back as codes, not abort the job.
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  MPI_Query_thread(&thread_level_);
  FailureLedger& l = Ledger();
  std::lock_guard<std::mutex> lock(l.mu);
  for (auto& [c, settled] : l.live) {
    if (c->poisoned()) settled = true;
  }
  l.unsettled.clear();
  l.live[this] = false;
}

std::string MpiCommunicator::ConcurrentUseProblem() const {
  if (thread_level_ >= MPI_THREAD_MULTIPLE) return {};
  const char* names[] = {"MPI_THREAD_SINGLE", "MPI_THREAD_FUNNELED", "MPI_THREAD_SERIALIZED"};
  const int i = thread_level_ == MPI_THREAD_SINGLE       ? 0
                : thread_level_ == MPI_THREAD_FUNNELED   ? 1
                : thread_level_ == MPI_THREAD_SERIALIZED ? 2
                                                         : -1;
  return std::string("MPI provides only ") + (i >= 0 ? names[i] : "an unknown thread level") +
         ", but a background saver calls MPI from its own thread while the training thread may "
         "too, which needs MPI_THREAD_MULTIPLE: initialise MPI with dcp::InitMpi (or "
         "MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...)) and use an MPI library built with "
         "thread support";
}

std::unique_ptr<Communicator> MpiCommunicator::Duplicate() {
  ThrowIfPoisoned("duplicate");
  return std::make_unique<MpiCommunicator>(comm_, timeout());
}

MpiCommunicator::~MpiCommunicator() {
  {
    FailureLedger& l = Ledger();
    std::lock_guard<std::mutex> lock(l.mu);
    auto it = l.live.find(this);
    if (it != l.live.end()) {
      if (!it->second && Unsettled(*this)) l.unsettled = poison_reason();
      l.live.erase(it);
    }
  }
  // A stopped communicator promised no further MPI call (MPI may be finalised by now, e.g. when
  // a saver detached at shutdown ends later), and so does one outliving MPI: leave the sends
  // and the communicator to MPI_Finalize.
  int finalized = 0;
  if (!stopped()) MPI_Finalized(&finalized);
  if (stopped() || finalized) {
    for (auto& p : pending_) p.release();  // NOLINT: intentionally leaked, see above
    return;
  }
  // Give in-flight sends a bounded time to complete; a send to a dead peer is left behind
  // (its buffer deliberately leaked) rather than freed under MPI's feet.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!pending_.empty() && std::chrono::steady_clock::now() < deadline) {
    ReapCompletedSends();
    if (!pending_.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  for (auto& p : pending_) {
    MPI_Request_free(&p->request);
    p.release();  // NOLINT: intentionally leaked, see above
  }
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void MpiCommunicator::ReapCompletedSends() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    int done = 0;
    MPI_Test(&(*it)->request, &done, MPI_STATUS_IGNORE);
    it = done ? pending_.erase(it) : std::next(it);
  }
}

void MpiCommunicator::Send(int dest, int tag, std::string payload) {
  ReapCompletedSends();
  if (payload.size() > static_cast<size_t>(INT_MAX)) {
    throw InvalidArgumentError("control message of " + std::to_string(payload.size()) +
                               " bytes exceeds MPI's 2 GiB message limit");
  }
  auto p = std::make_unique<PendingSend>();
  p->buffer = std::move(payload);
  Check(MPI_Isend(p->buffer.data(), static_cast<int>(p->buffer.size()), MPI_BYTE, dest, tag, comm_,
                  &p->request),
        "MPI_Isend");
  pending_.push_back(std::move(p));
}

void MpiCommunicator::SendShared(int dest, int tag, std::shared_ptr<const std::string> payload) {
  ReapCompletedSends();
  if (payload->size() > static_cast<size_t>(INT_MAX)) {
    throw InvalidArgumentError("control message of " + std::to_string(payload->size()) +
                               " bytes exceeds MPI's 2 GiB message limit");
  }
  // MPI allows several pending sends from one buffer; it lives until the last one completes.
  auto p = std::make_unique<PendingSend>();
  p->shared = std::move(payload);
  Check(MPI_Isend(p->shared->data(), static_cast<int>(p->shared->size()), MPI_BYTE, dest, tag,
                  comm_, &p->request),
        "MPI_Isend");
  pending_.push_back(std::move(p));
}

std::optional<std::string> MpiCommunicator::TryReceive(int source, int tag) {
  int flag = 0;
  MPI_Message msg;
  MPI_Status status;
  Check(MPI_Improbe(source, tag, comm_, &flag, &msg, &status), "MPI_Improbe");
  if (!flag) {
    ReapCompletedSends();
    return std::nullopt;
  }
  int count = 0;
  MPI_Get_count(&status, MPI_BYTE, &count);
  std::string out(static_cast<size_t>(count), '\0');
  Check(MPI_Mrecv(out.data(), count, MPI_BYTE, &msg, MPI_STATUS_IGNORE), "MPI_Mrecv");
  return out;
}

void MpiCommunicator::ExchangeBytes(const std::vector<BulkSend>& sends,
                                    const std::vector<BulkReceive>& receives,
                                    std::string_view what) {
  constexpr int kBulkTag = 2;  // neither dcp's frames (0) nor poison notices (1)
  constexpr size_t kMaxMessage = size_t{1} << 30;
  ThrowIfPoisoned(what);
  std::vector<MPI_Request> requests;
  std::vector<int> request_peer;
  std::vector<bool> is_receive;
  {
    std::lock_guard<std::mutex> lock(transport_mutex());
    if (stopped()) ThrowIfPoisoned(what);
    for (const auto& r : receives) {
      for (size_t at = 0; at < r.size || (at == 0 && r.size == 0); at += kMaxMessage) {
        const int n = static_cast<int>(std::min(kMaxMessage, r.size - at));
        requests.emplace_back();
        Check(MPI_Irecv(r.data + at, n, MPI_BYTE, r.peer, kBulkTag, comm_, &requests.back()),
              "MPI_Irecv");
        request_peer.push_back(r.peer);
        is_receive.push_back(true);
        if (r.size == 0) break;
      }
    }
    for (const auto& s : sends) {
      for (size_t at = 0; at < s.size || (at == 0 && s.size == 0); at += kMaxMessage) {
        const int n = static_cast<int>(std::min(kMaxMessage, s.size - at));
        requests.emplace_back();
        // MPI_Isend takes a non-const buffer in older MPIs; it only reads it.
        Check(MPI_Isend(const_cast<char*>(s.data) + at, n, MPI_BYTE, s.peer, kBulkTag, comm_,
                        &requests.back()),
              "MPI_Isend");
        request_peer.push_back(s.peer);
        is_receive.push_back(false);
        if (s.size == 0) break;
      }
    }
  }
  // Polled rather than waited on, so that a timeout or a poisoning ends the wait. A large
  // message advances only while both ranks poll MPI: where MPI has no single-copy transport
  // (CMA disabled, as in many containers) each poll moves a few shared-memory fragments, and
  // sleeping between polls cut a replica's throughput to a quarter. So the poll spins
  // (yielding the core) as long as requests complete, and sleeps between polls only once none
  // has for kSpinWindow: a peer that is late, not a transfer under way.
  constexpr auto kSpinWindow = std::chrono::milliseconds(100);
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + timeout();
  auto last_progress = start;
  std::vector<int> completed(requests.size());
  while (true) {
    int count = 0;
    {
      std::lock_guard<std::mutex> lock(transport_mutex());
      if (stopped()) break;
      Check(MPI_Testsome(static_cast<int>(requests.size()), requests.data(), &count,
                         completed.data(), MPI_STATUSES_IGNORE),
            "MPI_Testsome");
    }
    if (count == MPI_UNDEFINED) return;  // every request is complete (MPI_REQUEST_NULL)
    const auto now = std::chrono::steady_clock::now();
    if (count > 0) last_progress = now;
    if (poisoned() || now >= deadline) break;
    if (now - last_progress < kSpinWindow) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  // Timed out (or poisoned, or stopped): the buffers may still be touched by MPI, which the
  // contract leaves to the caller; the communicator is unusable from here on.
  std::vector<RankFailure> failures;
  std::set<int> waiting;
  {
    std::lock_guard<std::mutex> lock(transport_mutex());
    for (size_t i = 0; i < requests.size(); ++i) {
      int flag = 1;
      if (!stopped() && requests[i] != MPI_REQUEST_NULL) {
        MPI_Test(&requests[i], &flag, MPI_STATUS_IGNORE);
      }
      if (!flag) waiting.insert(request_peer[i]);
    }
  }
  for (int peer : waiting) {
    failures.push_back({peer, ErrorCode::kTimeout,
                        "bulk exchange '" + std::string(what) + "': rank " + std::to_string(peer) +
                            " did not complete its transfers with rank " + std::to_string(rank()) +
                            " within " + std::to_string(timeout().count()) + " ms",
                        true});
  }
  if (failures.empty()) {
    failures.push_back({rank(), ErrorCode::kCollective,
                        "bulk exchange '" + std::string(what) + "' stopped: " + poison_reason(),
                        false});
  }
  Poison("bulk exchange '" + std::string(what) + "' failed");
  throw CollectiveError(std::string(what), std::move(failures));
}

int InitMpi(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = MPI_THREAD_SINGLE;
  if (initialized) {
    MPI_Query_thread(&provided);
    return provided;
  }
  MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
  std::atexit([] {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    // MPI_Finalize waits for every rank. After a dcp failure the job did not get past (this
    // rank caught a CollectiveError and returned from main), a peer may wait for this rank in
    // a collective, dcp's or the application's, and never arrive: end the job instead, so
    // that it ends at once and non-zero. The only MPI_Abort dcp makes.
    std::string why = UnsettledFailure();
    if (!why.empty()) {
      if (why.size() > 400) why = why.substr(0, 400) + "...";
      int rank = -1;
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      std::fprintf(stderr,
                   "dcp: rank %d: ending the MPI job (MPI_Abort, exit code %d) instead of "
                   "MPI_Finalize, which would wait for peers that may never arrive: a dcp "
                   "collective failed and no communicator was made after it (%s)\n",
                   rank, kExitCodeAfterFailure, why.c_str());
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, kExitCodeAfterFailure);
    }
    MPI_Finalize();
  });
  return provided;
}

}  // namespace dcp
