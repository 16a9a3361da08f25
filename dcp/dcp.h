// The public face of dcp: include this one header.
//
//   dcp::StateDict sd;
//   sd.Set("step", dcp::Blob{"100"});
//   sd.Nested("model").Set("weight", dcp::TensorView::FromContiguous(ptr, dcp::DType::kFloat32,
//   {1024, 1024})); dcp::MpiCommunicator comm;                       // or dcp::LocalCommunicator
//   dcp::Save(sd, "/ckpt/step100", comm);            // every rank, collectively
//   dcp::Load(sd, "/ckpt/step100", comm);            // in place, any layout, any world size
#pragma once

#include "dcp/async_checkpointer.h"
#include "dcp/checkpoint.h"
#include "dcp/checkpoint_manager.h"
#include "dcp/communicator.h"
#include "planner/default_planner.h"
#include "planner/flatten.h"
#include "planner/planner.h"
#include "proto/codec.h"
#include "proto/error.h"
#include "proto/plan.h"
#include "proto/state_dict.h"
#include "proto/tensor.h"
#include "storage/registry.h"
#include "storage/storage.h"
#include "storage/store.h"
