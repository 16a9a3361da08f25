// The public face of dcp: include this one header.
//
//   dcp::StateDict sd;
//   sd.Set("step", dcp::Blob{"100"});
//   sd.Nested("model").Set("weight", dcp::TensorView::FromContiguous(
//                                        ptr, dcp::DType::kFloat32, {1024, 1024}));
//   dcp::MpiCommunicator comm;                // or dcp::LocalCommunicator
//   dcp::Save(sd, "/ckpt/step100", comm);     // every rank, collectively
//   dcp::Load(sd, "/ckpt/step100", comm);     // in place, any layout, any world size
//
// Options: dcp/options.h. Saves in the background: dcp/async_checkpointer.h. Step-numbered
// checkpoints with retention and restore: dcp/checkpoint_manager.h. Lightning-style I/O:
// dcp/async_checkpointer.h. Custom planners: dcp/planner/. Storage backends: dcp/storage/registry.h.
// clang-format off
#pragma once
// clang-format on

// This release (CMake reads these lines: the package's version is this one).
#define DCP_VERSION_MAJOR 0
#define DCP_VERSION_MINOR 1
#define DCP_VERSION_PATCH 0
#define DCP_VERSION_STRING "0.1.0"

#include "dcp/async_checkpointer.h"
#include "dcp/checkpoint.h"
#include "dcp/checkpoint_manager.h"
#include "dcp/communicator.h"
#include "dcp/memory_tier.h"
#include "dcp/options.h"
#include "dcp/planner/default_planner.h"
#include "dcp/planner/planner.h"
#include "dcp/proto/error.h"
#include "dcp/proto/plan.h"
#include "dcp/proto/state_dict.h"
#include "dcp/proto/tensor.h"
#include "dcp/storage/registry.h"
#include "dcp/storage/storage.h"
#include "dcp/storage/store.h"
