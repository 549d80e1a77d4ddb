// NCCL backend. Compiled whenever nccl.h and the CUDA runtime headers are available, which
// scripts/setup arranges even on CPU-only machines, so the GPU path cannot rot unseen.
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "dist/backends.hpp"

namespace lorarun::dist {

NcclBuild nccl_build() {
  return {true, fmt::format("{}.{}.{}", NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH),
          fmt::format("{}.{}", CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10)};
}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    int device_index, std::chrono::milliseconds timeout) {
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device_index));
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
}

}  // namespace lorarun::dist
