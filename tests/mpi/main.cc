// Runs the Catch2 session on every rank of an MPI job. Every rank runs every test case in the
// same order; tests call dcp collectives, whose timeouts keep a diverging rank from hanging the
// job.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <memory>

#include "mpi/mpi_support.h"
#include "support/catch_runner.h"

namespace dcp::testing {
namespace {
std::unique_ptr<MpiCommunicator> g_comm;
int g_counter = 0;
}  // namespace

MpiCommunicator& Comm() { return *g_comm; }

std::string SharedDir(const std::string& tag) {
  std::string path;
  if (Comm().rank() == 0) {
    const char* base = std::getenv("DCP_TEST_TMPDIR");
    std::string root = base ? base : std::filesystem::temp_directory_path().string();
    path = root + "/dcp-mpi-" + tag + "-" + std::to_string(::getpid()) + "-" +
           std::to_string(g_counter++);
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  return Comm().Broadcast(path, 0, "test/shared-dir");
}

void ResetComm() {
  const auto timeout = g_comm->timeout();
  g_comm = std::make_unique<MpiCommunicator>(MPI_COMM_WORLD);
  g_comm->set_timeout(timeout);
}

void RemoveSharedDir(const std::string& path) {
  Comm().Barrier("test/remove-dir");
  if (Comm().rank() == 0 && std::getenv("DCP_KEEP_TEST_DIRS") == nullptr) {
    std::filesystem::remove_all(path);
  }
}

}  // namespace dcp::testing

int main(int argc, char** argv) {
  dcp::InitMpi(&argc, &argv);
  int rc;
  {
    dcp::testing::g_comm = std::make_unique<dcp::MpiCommunicator>(MPI_COMM_WORLD);
    dcp::testing::Comm().set_timeout(std::chrono::seconds(120));
    rc = dcp::testing::RunCatchSession(argc, argv, dcp::testing::Comm().rank() != 0);
    dcp::testing::g_comm.reset();
  }
  return rc;
}
