// Backend factories, internal to lib/dist: the NCCL one lives in its own translation unit, the
// only one that sees CUDA and NCCL headers.
#pragma once
#include <chrono>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "dist/process_group.hpp"

namespace lorarun::dist {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    int device_index, std::chrono::milliseconds timeout);

}  // namespace lorarun::dist
