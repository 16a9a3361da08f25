// MemoryTier::TransferFiles: moving a step's files between ranks, straight from the sender's
// mapping of a file to the receiver's.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "dcp/memory_tier.h"
#include "dcp/proto/error.h"
#include "dcp/storage/checkpoint/store_checkpoint.h"
#include "dcp/tier/file_mapping.h"
#include "dcp/tier/step_store.h"
#include "dcp/tier/tier_internal.h"

namespace dcp {

using namespace tier_detail;

namespace {

// The file headers between the pairs only: each rank sends every rank of `to` (even nothing)
// and receives from every rank of `from`, first the lengths, then the bytes. A save's partners
// are known to both sides, so it needs no AllToAll, whose message to every rank would make a
// save's cost grow with the job's size.
std::vector<std::string> ExchangeHeaders(Communicator& comm, const tier_detail::Pairs& pairs,
                                         const std::vector<std::string>& headers,
                                         std::string_view what) {
  std::vector<std::string> out_len(pairs.to.size()),
      in_len(pairs.from.size(), std::string(8, '\0'));
  std::vector<Communicator::BulkSend> sends;
  std::vector<Communicator::BulkReceive> receives;
  for (size_t k = 0; k < pairs.to.size(); ++k) {
    PutU64(out_len[k], headers[pairs.to[k]].size());
    sends.push_back({pairs.to[k], out_len[k].data(), out_len[k].size()});
  }
  for (size_t k = 0; k < pairs.from.size(); ++k) {
    receives.push_back({pairs.from[k], in_len[k].data(), in_len[k].size()});
  }
  comm.ExchangeBytes(sends, receives, what);
  std::vector<std::string> got(comm.size());
  sends.clear();
  receives.clear();
  for (int dest : pairs.to) sends.push_back({dest, headers[dest].data(), headers[dest].size()});
  for (size_t k = 0; k < pairs.from.size(); ++k) {
    const int source = pairs.from[k];
    const uint64_t n = MessageReader(in_len[k], "rank " + std::to_string(source)).U64();
    constexpr uint64_t kMaxHeaderBytes = uint64_t{1} << 30;
    if (n > kMaxHeaderBytes) {
      throw CorruptionError("memory tier: rank " + std::to_string(source) + " announces " +
                            std::to_string(n) + " bytes of file headers");
    }
    got[source].resize(n);
    receives.push_back({source, got[source].data(), got[source].size()});
  }
  comm.ExchangeBytes(sends, receives, what);
  return got;
}

// A pair's stream: its files, in order, each an open descriptor, a size and its mapping.
struct PairFile {
  std::string name;
  int fd = -1;
  uint64_t size = 0;
  char* data = nullptr;  // its bytes: the pool's mapping, or `map`
  FileMapping map;       // a sent file the pool does not hold (written by another process)
};
struct Stream {
  std::vector<PairFile> files;
  uint64_t total = 0;
};

// One transfer's streams on this rank, to each receiver and from each sender, with the first
// failure met (as ErrorText) for the votes. The caller closes them (CloseAll) on every path it
// returns by; a transfer whose bytes failed to move leaves its mappings (MoveRounds).
class FileTransfer {
 public:
  FileTransfer(MappingPool& pool, TierStats& stats, std::string dir, std::string recycle,
               uint64_t chunk)
      : pool_(pool),
        stats_(stats),
        dir_(std::move(dir)),
        recycle_(std::move(recycle)),
        chunk_(chunk) {}

  const std::string& error() const { return error_; }

  // Opens and maps the files this rank sends, adding each one's name and size to the header
  // for its receiver; returns the rounds this rank's streams need.
  uint64_t OpenOutgoing(const std::vector<Transfer>& outgoing, std::vector<std::string>& headers) {
    for (const auto& t : outgoing) {
      Stream& st = out_streams_[t.dest];
      PairFile f;
      f.name = t.name;
      try {
        OpenSent(f);
      } catch (const std::exception& e) {
        Fail(ErrorText(e));
      }
      st.total += f.size;
      PutString(headers[t.dest], f.name);
      PutU64(headers[t.dest], f.size);
      st.files.push_back(std::move(f));
    }
    uint64_t my_rounds = 0;
    for (const auto& [peer, st] : out_streams_) {
      my_rounds = std::max(my_rounds, (st.total + chunk_ - 1) / chunk_);
    }
    return my_rounds;
  }

  // Creates (over recycled files), reserves and maps the files the headers `got` announce.
  void OpenIncoming(const std::vector<std::string>& got) {
    bool have_dir = false;
    for (int source = 0; source < static_cast<int>(got.size()); ++source) {
      try {
        MessageReader in(got[source], "rank " + std::to_string(source));
        while (!in.done()) {
          PairFile f;
          f.name = in.String();
          f.size = in.U64();
          if (!IsPlainName(f.name) || f.name == TierMetadataName()) {
            throw CorruptionError("memory tier: rank " + std::to_string(source) +
                                  " sends a file named '" + ClippedName(f.name) + "'");
          }
          if (!have_dir) {
            MakePrivateDirectory(dir_);
            have_dir = true;
          }
          Stream& st = in_streams_[source];
          st.total += f.size;
          const std::string path = dir_ + "/" + f.name;
          f.fd = OpenForOverwrite(recycle_, path, pool_);
          st.files.push_back(std::move(f));
          PairFile& placed = st.files.back();
          ReserveExactly(placed.fd, placed.size, path);
          placed.data = pool_.Map(placed.fd, placed.size, path);
        }
      } catch (const std::exception& e) {
        Fail(ErrorText(e));
      }
    }
  }

  // Every rank's files are ready (a vote): the rounds the longest stream of any rank needs.
  uint64_t AgreeOnRounds(Communicator& comm, uint64_t my_rounds, std::string_view what) {
    uint64_t rounds = 0;
    try {
      Vote(comm, error_, std::string(what) + "/ready");
      for (const auto& r : comm.AllGather(std::to_string(my_rounds), what)) {
        rounds = std::max<uint64_t>(rounds, std::stoull(r));
      }
    } catch (...) {
      CloseAll();
      throw;
    }
    return rounds;
  }

  // Every file is mapped on every rank (the vote passed): the bytes move, a round at a time.
  void MoveRounds(Communicator& comm, uint64_t rounds, std::string_view what) {
    for (uint64_t round = 0; round < rounds; ++round) {
      std::vector<Communicator::BulkSend> sends;
      std::vector<Communicator::BulkReceive> receives;
      for (auto& [peer, st] : out_streams_) {
        ForEachPiece(st, round, [&, peer = peer](char* data, size_t n) {
          sends.push_back({peer, data, n});
          stats_.bytes_sent += n;
        });
      }
      for (auto& [peer, st] : in_streams_) {
        ForEachPiece(st, round, [&, peer = peer](char* data, size_t n) {
          receives.push_back({peer, data, n});
          stats_.bytes_received += n;
        });
      }
      try {
        comm.ExchangeBytes(sends, receives, what);
      } catch (...) {
        LeakAndClose();
        throw;
      }
    }
  }

  // Truncates and closes the received files, naming them in `received` (when set).
  void CloseReceived(std::vector<std::string>* received) {
    for (auto& [peer, st] : in_streams_) {
      for (auto& f : st.files) {
        try {
          f.map.Reset();
          const int fd = f.fd;
          f.fd = -1;
          TruncateAndClose(fd, f.size, dir_ + "/" + f.name);
          if (received) received->push_back(f.name);
        } catch (const std::exception& e) {
          Fail(ErrorText(e));
        }
      }
    }
  }

  void CloseAll() {
    for (auto* streams : {&out_streams_, &in_streams_}) {
      for (auto& [peer, st] : *streams) {
        for (auto& f : st.files) {
          f.map.Reset();
          if (f.fd >= 0) ::close(f.fd);
          f.fd = -1;
        }
      }
    }
  }

 private:
  void Fail(const std::string& e) {
    if (error_.empty()) error_ = e;
  }

  void OpenSent(PairFile& f) {
    const std::string path = dir_ + "/" + f.name;
    f.fd = OpenTierFile(path, O_RDWR);  // RDWR: the pool's mappings are
    struct stat sb {};
    if (::fstat(f.fd, &sb) != 0) {
      throw TierIoError("memory tier: cannot open " + path + ": " + std::strerror(errno));
    }
    f.size = static_cast<uint64_t>(sb.st_size);
    if (static_cast<uint64_t>(sb.st_blocks) * 512 >= f.size) {
      f.data = pool_.Map(f.fd, f.size, path);  // kept: the file comes back recycled
    } else {
      // A sparse file (not one the tier wrote) is read through a mapping of its own.
      f.map = FileMapping(f.fd, f.size, /*writable=*/false, path);
      f.data = f.map.data();
      stats_.bytes_mapped += f.size;
    }
  }

  // A round's window of a stream, [round * chunk, +chunk), is cut at its files' boundaries;
  // both sides know the sizes, so they cut alike, and the pieces match one for one.
  template <typename Piece>
  void ForEachPiece(Stream& st, uint64_t round, Piece&& piece) const {
    const uint64_t begin = round * chunk_;
    const uint64_t end = std::min(st.total, begin + chunk_);
    uint64_t file_start = 0;
    for (auto& f : st.files) {
      const uint64_t lo = std::max(begin, file_start), hi = std::min(end, file_start + f.size);
      if (lo < hi) piece(f.data + (lo - file_start), static_cast<size_t>(hi - lo));
      file_start += f.size;
      if (file_start >= end) break;
    }
  }

  // The transport may still write into the mappings of a poisoned communicator: leave them
  // mapped (they are the step's files, which the failed save removes by name).
  void LeakAndClose() {
    for (auto* streams : {&out_streams_, &in_streams_}) {
      for (auto& [peer, st] : *streams) {
        for (auto& f : st.files) f.map.Leak();
      }
    }
    pool_.Leak();
    CloseAll();
  }

  MappingPool& pool_;
  TierStats& stats_;
  const std::string dir_, recycle_;
  const uint64_t chunk_;
  std::string error_;
  std::map<int, Stream> out_streams_, in_streams_;
};

// The headers to the ranks this one sends to: between the pairs when both sides know them,
// else an AllToAll.
std::vector<std::string> SwapHeaders(Communicator& comm, const std::vector<Transfer>& outgoing,
                                     std::vector<std::string> headers, std::string_view what,
                                     const Pairs* pairs) {
  if (!pairs) return comm.AllToAll(std::move(headers), what);
  for (const auto& t : outgoing) {
    if (std::find(pairs->to.begin(), pairs->to.end(), t.dest) == pairs->to.end()) {
      throw InternalError("memory tier: a file for rank " + std::to_string(t.dest) +
                          ", which is not among the pairs");
    }
  }
  return ExchangeHeaders(comm, *pairs, headers, what);
}

}  // namespace

// First what each rank will send each other rank (file names and sizes: between the pairs, or
// an AllToAll); then the bytes, in rounds: each round moves up to transfer_chunk_bytes of every
// (sender, receiver) pair's stream (its files in order) through Communicator::ExchangeBytes,
// which MPI does without copies of its own. The bytes go straight from the sender's file to
// the receiver's, both mapped (the pool's mappings, kept across saves), so a replica costs the
// transport's copy and nothing else, where reading into and writing out of staging buffers
// cost two more copies (2.7x the exchange on 2 cores). The receiver reserves its files' pages
// (fallocate) before mapping them: a full tmpfs is an error then, not a SIGBUS in the middle of
// the transfer. Every file is opened and mapped before the bytes move (a vote first), so a
// failure never leaves a peer waiting for data that will not come; a vote at the end reports
// every outcome.
void MemoryTier::TransferFiles(Communicator& comm, int64_t step,
                               const std::vector<Transfer>& outgoing, std::string_view what,
                               std::vector<std::string>* received, const Pairs* pairs,
                               BusyScope* commit, TierStats* stats,
                               const std::string& carried_error) {
  FileTransfer transfer(*pool_, stats ? *stats : stats_, StepDirectory(step),
                        root_ + "/" + kRecycleDir, options_.transfer_chunk_bytes);
  std::vector<std::string> headers(comm.size());
  const uint64_t my_rounds = transfer.OpenOutgoing(outgoing, headers);
  transfer.OpenIncoming(SwapHeaders(comm, outgoing, std::move(headers), what, pairs));
  const uint64_t rounds = transfer.AgreeOnRounds(comm, my_rounds, what);
  transfer.MoveRounds(comm, rounds, what);
  transfer.CloseReceived(received);
  transfer.CloseAll();
  std::string error = carried_error.empty() ? transfer.error() : carried_error;
  if (commit) {
    commit->Enter();
    if (error.empty()) error = PreemptionVeto("the save of step " + std::to_string(step));
  }
  Vote(comm, error, std::string(what) + "/vote");
}

}  // namespace dcp
