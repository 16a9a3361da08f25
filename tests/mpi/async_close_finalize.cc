// A background save stuck in storage outlives AsyncCheckpointer::Close and MPI_Finalize: when the
// storage call returns, the detached saver ends and destroys its MpiCommunicator after MPI was
// finalised. Before, that destructor called MPI_Test and Open MPI aborted the job (exit 1); now a
// stopped communicator makes no MPI call at all, so this program exits 0. Run under mpirun with
// 2 or more ranks (rank 0's plan replies are still pending sends when it enters storage).
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>

#include "dcp/dcp.h"
#include "dcp/mpi_communicator.h"
#include "dcp/storage/backends/fault_store.h"
#include "dcp/storage/backends/file_store.h"

namespace {
int failures = 0;
void Check(bool ok, const std::string& what, int rank) {
  if (ok) return;
  std::fprintf(stderr, "rank %d: FAILED: %s\n", rank, what.c_str());
  ++failures;
}
}  // namespace

int main(int argc, char** argv) {
  dcp::InitMpi(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);

  // A directory every rank agrees on.
  char dir[512] = {};
  if (rank == 0) {
    const char* base = std::getenv("DCP_TEST_TMPDIR");
    const std::string root = base ? base : std::filesystem::temp_directory_path().string();
    const std::string path = root + "/dcp-close-finalize-" + std::to_string(::getpid());
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
    std::snprintf(dir, sizeof(dir), "%s", path.c_str());
  }
  MPI_Bcast(dir, sizeof(dir), MPI_CHAR, 0, MPI_COMM_WORLD);

  // Every data write sleeps: the save is inside storage when Close gives up on it.
  auto store = std::make_shared<dcp::FaultInjectionStore>(dcp::MakeFileStore(dir));
  store->Delay(dcp::FaultOp::kAppend, std::chrono::milliseconds(3000));
  dcp::RegisterFaultScheme("slowappend", store);

  std::vector<float> values(1024, static_cast<float>(rank));
  dcp::StateDict sd;
  sd.Set("w" + std::to_string(rank),
         dcp::TensorView::FromContiguous(values.data(), dcp::DType::kFloat32, {1024}));

  std::shared_ptr<dcp::AsyncSave> handle;
  {
    dcp::AsyncCheckpointer saver(
        std::make_unique<dcp::MpiCommunicator>(MPI_COMM_WORLD, std::chrono::seconds(60)));
    handle = saver.Save(sd, "slowappend://ckpt");
    // Let every rank reach its data writes (planning takes milliseconds).
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    bool threw = false;
    try {
      saver.Close(std::chrono::milliseconds(100));
    } catch (const dcp::Error& e) {
      threw = std::string(e.what()).find("unfinished") != std::string::npos;
    }
    Check(threw, "Close reports the stuck save as unfinished", rank);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  MPI_Finalize();

  // The stuck writes return now; the saver fails at its next collective (its communicator is
  // stopped) and, ending, destroys that communicator: after MPI_Finalize, with no MPI call.
  Check(handle->WaitFor(std::chrono::seconds(60)), "the detached save ends", rank);
  bool failed = false;
  try {
    handle->Wait();
  } catch (const dcp::Error&) {
    failed = true;
  }
  Check(failed, "the detached save reports a failure", rank);
  // Give the ended thread time to destroy what it owned (the communicator).
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  if (rank == 0) std::filesystem::remove_all(dir);
  if (failures == 0 && rank == 0) std::printf("async close after finalize: ok\n");
  return failures == 0 ? 0 : 1;
}
