#include "dist/process_group.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <cstdlib>
#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "dist/backends.hpp"
#include "util/error.hpp"

namespace lorarun::dist {

std::string_view backend_name(Backend b) { return b == Backend::Nccl ? "nccl" : "gloo"; }

Backend resolve_backend(std::string_view name, bool cuda) {
  if (name == "nccl") return Backend::Nccl;
  if (name == "gloo") return Backend::Gloo;
  if (name == "auto") return cuda ? Backend::Nccl : Backend::Gloo;
  throw Error(fmt::format("dist.backend: '{}' is not one of auto, nccl, gloo", name));
}

#ifndef LORARUN_HAVE_NCCL
NcclBuild nccl_build() { return {}; }

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>&, int,
                                                    int, int, std::chrono::milliseconds) {
  throw Error("this lora-train was built without NCCL: rebuild where nccl.h and the CUDA headers "
              "are found (scripts/setup installs them), or set dist.backend: gloo");
}
#endif

namespace {

// First line of a c10 error, without the C++ stack trace torch appends.
std::string short_message(const c10::Error& e) {
  std::string m = e.what_without_backtrace();
  return m.substr(0, m.find('\n'));
}

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

std::shared_ptr<gloo::transport::Device> gloo_device(const DistEnv& env) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname)
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  // All ranks on this machine: talk over loopback rather than whatever the hostname resolves to.
  if (is_loopback(env.master_addr)) return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

}  // namespace

struct ProcessGroup::Impl {
  DistEnv env;
  Backend backend;
  c10::Device device{c10::kCPU};
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> pg;
};

ProcessGroup::ProcessGroup(const DistEnv& env, Backend backend, std::chrono::seconds timeout)
    : impl_(std::make_unique<Impl>()) {
  impl_->env = env;
  impl_->backend = backend;
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(timeout);
  try {
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<uint16_t>(env.master_port);
    opts.isServer = env.rank == 0;
    opts.numWorkers = env.world_size;
    opts.waitWorkers = true;
    opts.timeout = ms;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
    // Keys per restart attempt, as torchrun's /worker/attempt_N: a restarted group never reads
    // what the previous attempt left in a store that outlived it.
    const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
    impl_->store = c10::make_intrusive<c10d::PrefixStore>(
        fmt::format("lorarun/attempt_{}/default_pg", attempt && *attempt ? attempt : "0"), tcp);
  } catch (const c10::Error& e) {
    throw Error(fmt::format("rank {}: rendezvous at {}:{} failed ({}): check MASTER_ADDR/MASTER_PORT "
                            "and that all {} ranks were started", env.rank, env.master_addr,
                            env.master_port, short_message(e), env.world_size));
  }
  try {
    if (backend == Backend::Nccl) {
      impl_->device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
      impl_->pg = make_nccl_backend(impl_->store, env.rank, env.world_size, env.local_rank, ms);
    } else {
      auto opts = c10d::ProcessGroupGloo::Options::create(ms);
      opts->devices.push_back(gloo_device(env));
      impl_->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(impl_->store, env.rank,
                                                              env.world_size, opts);
    }
  } catch (const c10::Error& e) {
    throw Error(fmt::format("rank {}: creating the {} process group failed: {}", env.rank,
                            backend_name(backend), short_message(e)));
  }
}

ProcessGroup::~ProcessGroup() = default;

int ProcessGroup::rank() const { return impl_->env.rank; }
int ProcessGroup::size() const { return impl_->env.world_size; }
Backend ProcessGroup::backend() const { return impl_->backend; }

void ProcessGroup::all_reduce_sum(at::Tensor& t) {
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  try {
    impl_->pg->allreduce(tensors, opts)->wait();
  } catch (const c10::Error& e) {
    throw Error(fmt::format("rank {}: all-reduce failed, another rank has probably stopped: {}",
                            impl_->env.rank, short_message(e)));
  }
}

struct ProcessGroup::Pending::Impl {
  c10::intrusive_ptr<c10d::Work> work;
  int rank = 0;
};
ProcessGroup::Pending::Pending(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ProcessGroup::Pending::Pending(Pending&&) noexcept = default;
ProcessGroup::Pending::~Pending() = default;

void ProcessGroup::Pending::wait() {
  try {
    impl_->work->wait();
  } catch (const c10::Error& e) {
    throw Error(fmt::format("rank {}: all-reduce failed, another rank has probably stopped: {}", impl_->rank,
                            short_message(e)));
  }
}

ProcessGroup::Pending ProcessGroup::all_reduce_sum_async(at::Tensor& t) {
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  auto impl = std::make_unique<Pending::Impl>();
  impl->rank = impl_->env.rank;
  try {
    impl->work = impl_->pg->allreduce(tensors, opts);
  } catch (const c10::Error& e) {
    throw Error(fmt::format("rank {}: all-reduce failed, another rank has probably stopped: {}",
                            impl_->env.rank, short_message(e)));
  }
  return Pending(std::move(impl));
}

void ProcessGroup::barrier() {
  at::Tensor one = at::ones({1}, at::TensorOptions().device(impl_->device));
  all_reduce_sum(one);
}

}  // namespace lorarun::dist
