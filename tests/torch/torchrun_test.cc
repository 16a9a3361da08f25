// Jobs without MPI (ConnectTorchrun, dcp/torch_adapter.h; issue 47): the bootstrap's errors, and
// the collectives' guarantees over c10d's Gloo, with the ranks as threads of one process on
// loopback.
#define CATCH_CONFIG_PREFIX_ALL
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "dcp/dcp.h"
#include "dcp/torch_adapter.h"
#include "support/test_support.h"

using namespace dcp;
using Catch::Matchers::Contains;

namespace {

// A TCP port free on loopback now (the kernel's pick).
uint16_t FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t n = sizeof a;
  CATCH_REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  CATCH_REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n) == 0);
  ::close(fd);
  return ntohs(a.sin_port);
}

// fn(rank, group) on `world` threads, each its own process's part of one job.
template <typename Fn>
void RunJob(int world, std::chrono::milliseconds timeout, Fn fn) {
  const uint16_t port = FreePort();
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        TorchrunGroup g = ConnectStore({"127.0.0.1", port, r, world, r == 0}, timeout);
        fn(r, g);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    if (errors[r]) std::rethrow_exception(errors[r]);
  }
}

}  // namespace

CATCH_TEST_CASE("torchrun: a missing or malformed launcher variable is named",
                "[torchrun][torch]") {
  const char* kept = std::getenv("RANK");
  const std::string saved = kept ? kept : "";
  ::setenv("WORLD_SIZE", "4", 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", "29500", 1);
  ::unsetenv("RANK");
  CATCH_CHECK_THROWS_WITH(ConnectTorchrun(), Contains("RANK is not set"));
  ::setenv("RANK", "4", 1);
  CATCH_CHECK_THROWS_WITH(ConnectTorchrun(), Contains("RANK='4' is not a number in [0, 3]"));
  ::setenv("RANK", "0", 1);
  ::setenv("MASTER_PORT", "http", 1);
  CATCH_CHECK_THROWS_AS(ConnectTorchrun(), InvalidArgumentError);
  for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) ::unsetenv(v);
  if (kept) ::setenv("RANK", saved.c_str(), 1);
}

CATCH_TEST_CASE(
    "torchrun: collectives over Gloo deliver every rank's bytes, and a rank that does not "
    "answer is named when the deadline passes",
    "[torchrun][torch]") {
  constexpr int kWorld = 3;
  std::vector<std::string> gathered(kWorld), broadcast(kWorld);
  std::vector<std::string> timeout_message(kWorld);
  RunJob(kWorld, std::chrono::seconds(3), [&](int rank, TorchrunGroup& g) {
    auto all = g.comm->AllGather("rank " + std::to_string(rank), "gather");
    for (const auto& m : all) gathered[rank] += m + ";";
    // Large enough to span many socket writes; on the background group, concurrently with
    // the job's group's barrier.
    std::thread bg([&] {
      std::string big(3 << 20, '\0');
      for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 7 + 1);
      broadcast[rank] = g.background->Broadcast(rank == 1 ? big : std::string(), 1, "big");
      if (broadcast[rank] != big) broadcast[rank] = "differs";
    });
    g.comm->Barrier("meanwhile");
    bg.join();
    // Rank 2 never joins this collective: the others fail at their deadline, naming it.
    if (rank == 2) return;
    g.comm->set_timeout(std::chrono::milliseconds(500));
    try {
      g.comm->AllGather("late", "nobody-from-rank-2");
    } catch (const CollectiveError& e) {
      if (e.timed_out()) timeout_message[rank] = e.what();
    }
  });
  for (int r = 0; r < kWorld; ++r) {
    CATCH_CHECK(gathered[r] == "rank 0;rank 1;rank 2;");
    CATCH_CHECK(broadcast[r].size() == size_t{3} << 20);
  }
  // Rank 0 gathers: it names rank 2. Rank 1 waits on rank 0 with the same deadline, so it may
  // name rank 0 or pass on rank 0's report; either way it fails, in time.
  CATCH_CHECK_THAT(timeout_message[0], Contains("nobody-from-rank-2") &&
                                           Contains("rank 2 did not answer within 500 ms"));
  CATCH_CHECK_THAT(timeout_message[1], Contains("nobody-from-rank-2"));
}

CATCH_TEST_CASE("torchrun: a job without MPI saves and loads resharded through its group",
                "[torchrun][torch]") {
  dcp::testing::TempDir dir("torchrun");
  const std::string where = dir.path() + "/ckpt";
  const TensorView full = dcp::testing::RandomTensor(DType::kFloat32, {23, 5}, 7);
  RunJob(3, std::chrono::seconds(60), [&](int rank, TorchrunGroup& g) {
    auto [r0, r1] = dcp::testing::RowRange(23, rank, 3);
    StateDict sd;
    ShardedTensor st{DType::kFloat32, {23, 5}, {}};
    st.local_shards.push_back({dcp::testing::Clone(full.Narrow({r0, 0}, {r1 - r0, 5})), {r0, 0}});
    sd.Set("w", st);
    Save(sd, where, *g.comm);
    // Back as two column shards on ranks 0 and 1 (rank 2 asks for nothing).
    StateDict back;
    ShardedTensor cols{DType::kFloat32, {23, 5}, {}};
    if (rank < 2) {
      const int64_t c0 = rank == 0 ? 0 : 3, c1 = rank == 0 ? 3 : 5;
      cols.local_shards.push_back({TensorView::Allocate(DType::kFloat32, {23, c1 - c0}), {0, c0}});
    }
    back.Set("w", cols);
    Load(back, where, *g.comm);
    for (const auto& shard : std::get<ShardedTensor>(*back.Find("w")).local_shards) {
      dcp::testing::Expect(
          dcp::testing::SameElements(full.Narrow(shard.offsets, shard.view.shape), shard.view),
          "bit-exact, resharded");
    }
  });
}
