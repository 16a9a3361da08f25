// A memory-tier job of two in-process ranks (two simulated nodes, one replica), for the
// two-users test (tests/tier/two_users.sh): it runs under another uid through setpriv.
//
//   tier_user_check save SHM_ROOT      saves steps 1 to 3 of a small state; prints "saved"
//   tier_user_check restore SHM_ROOT   restores; prints "restored step N", "restored nothing",
//                                      or "refused: <why>" (exit 3) when the tier is refused
// Exit 0 unless something unexpected failed (then 1, with the error on stderr).
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "dcp/dcp.h"

namespace {

constexpr int kWorld = 2;

dcp::MemoryTierOptions Options(const std::string& shm_root) {
  dcp::MemoryTierOptions o;
  o.shm_root = shm_root;  // name "default", no owner: the standalone defaults
  o.ranks_per_node = 1;
  return o;
}

// Rank `rank`'s state at `step`: 1024 floats of value step * 1000 + rank.
struct State {
  dcp::TensorView w = dcp::TensorView::Allocate(dcp::DType::kFloat32, {1024});
  dcp::StateDict sd;
  State(int rank, int64_t step) {
    for (int i = 0; i < 1024; ++i) static_cast<float*>(w.data)[i] = step * 1000.0f + rank;
    sd.Set("w" + std::to_string(rank), w);
  }
  bool Holds(int rank, int64_t step) const {
    for (int i = 0; i < 1024; ++i) {
      if (static_cast<const float*>(w.data)[i] != step * 1000.0f + rank) return false;
    }
    return true;
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: tier_user_check save|restore SHM_ROOT\n");
    return 2;
  }
  const std::string mode = argv[1], shm_root = argv[2];
  dcp::InProcessGroup group(kWorld);
  std::vector<std::string> outcome(kWorld), error(kWorld);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorld; ++r) {
    ranks.emplace_back([&, r] {
      try {
        dcp::MemoryTier tier(group.communicator(r), Options(shm_root));
        if (mode == "save") {
          for (int64_t s = 1; s <= 3; ++s) {
            State state(r, s);
            tier.Save(s, state.sd);
          }
          outcome[r] = "saved";
        } else {
          State state(r, 0);
          std::memset(state.w.data, 0, state.w.nbytes());
          auto step = tier.Restore(state.sd);
          if (!step) {
            outcome[r] = "restored nothing";
          } else if (!state.Holds(r, *step)) {
            error[r] = "step " + std::to_string(*step) + " restored other values";
          } else {
            outcome[r] = "restored step " + std::to_string(*step);
          }
        }
      } catch (const dcp::CollectiveError& e) {
        if (!e.failures().empty() &&
            e.failures().front().code == dcp::ErrorCode::kInvalidArgument) {
          outcome[r] = std::string("refused: ") + e.what();
        } else {
          error[r] = e.what();
        }
      } catch (const std::exception& e) {
        error[r] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < kWorld; ++r) {
    if (!error[r].empty()) {
      std::fprintf(stderr, "rank %d: %s\n", r, error[r].c_str());
      return 1;
    }
  }
  std::printf("%s\n", outcome[0].c_str());
  return outcome[0].rfind("refused", 0) == 0 ? 3 : 0;
}
