// Built (not run) against the installed package's MPI component: its headers and link line.
// It holds README.md's first example (tests/readme_snippet_check.py keeps the two equal).
#include <dcp/dcp.h>
#include <dcp/mpi_communicator.h>

#include <cstdint>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  // [readme-quickstart]
  dcp::InitMpi(&argc, &argv);  // MPI_THREAD_MULTIPLE
  {
    dcp::MpiCommunicator comm;  // a private duplicate of MPI_COMM_WORLD
    const int64_t vocab = 1024, d = 64;
    const int64_t rows = vocab / comm.size(), row0 = rows * comm.rank();  // this rank's rows
    std::vector<float> embed(rows * d), norm(d);
    std::string rng_bytes = "any bytes";

    dcp::StateDict sd;
    sd.Nested("model").Set(
        "embed",
        dcp::ShardedTensor{
            dcp::DType::kFloat32,
            {vocab, d},
            {{dcp::TensorView::FromContiguous(embed.data(), dcp::DType::kFloat32, {rows, d}),
              {row0, 0}}}});
    sd.Nested("model").Set("norm",
                           dcp::TensorView::FromContiguous(norm.data(), dcp::DType::kFloat32, {d}));
    sd.Set("rng", dcp::Blob{rng_bytes});
    dcp::Save(sd, "/tmp/ckpt/step-100", comm);  // or file://, mem://, s3://, a registered scheme
    dcp::Load(sd, "/tmp/ckpt/step-100", comm);  // in place; any saved layout into any layout
  }
  MPI_Finalize();
  // [readme-quickstart-end]
  return 0;
}
