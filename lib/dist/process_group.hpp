// The process group every rank joins: TCPStore rendezvous, then Gloo (CPU) or NCCL (CUDA).
#pragma once
#include <chrono>
#include <memory>
#include <string>
#include <string_view>

#include "dist/env.hpp"

namespace at {
class Tensor;
}

namespace lorarun::recipe {
enum class DistBackend;
}

namespace lorarun::dist {

enum class Backend { Gloo, Nccl };

std::string_view backend_name(Backend b);

// "auto" picks NCCL when training on CUDA and Gloo otherwise; "nccl" or "gloo" force one.
Backend resolve_backend(std::string_view name, bool cuda);
// The same for the recipe's dist.backend.
Backend backend_of(recipe::DistBackend b, bool cuda);

// What this binary was built with, for --check-env.
struct NcclBuild {
  bool compiled = false;     // the NCCL process group is compiled into this binary
  std::string nccl_version;  // of the nccl.h it was compiled against
  std::string cuda_version;  // of the CUDA runtime headers
};
NcclBuild nccl_build();

class ProcessGroup {
 public:
  // Rendezvous on MASTER_ADDR:MASTER_PORT through a TCPStore hosted by rank 0, then create the
  // backend. Throws lorarun::Error (with the address and the fix) when the rendezvous fails.
  ProcessGroup(const DistEnv& env, Backend backend, std::chrono::seconds timeout);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const;
  int size() const;
  Backend backend() const;

  // Sums `t` over all ranks, in place. `t` must live on the backend's device.
  void all_reduce_sum(at::Tensor& t);
  // The same, started and not waited for: `t` holds the sum once wait() returns. Every rank must
  // start its collectives in the same order.
  class Pending {
   public:
    Pending(Pending&&) noexcept;
    ~Pending();
    void wait();

   private:
    friend class ProcessGroup;
    struct Impl;
    explicit Pending(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
  };
  Pending all_reduce_sum_async(at::Tensor& t);
  // Every rank's `in` ([n]; the same n and dtype on every rank) into `out` ([size() * n]), in rank
  // order, started and not waited for (the rules of all_reduce_sum_async). Gathers the slices of
  // a sharded tensor (model/sharded.hpp).
  Pending all_gather_async(at::Tensor& out, const at::Tensor& in);
  void barrier();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lorarun::dist
