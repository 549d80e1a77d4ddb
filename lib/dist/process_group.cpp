#include "dist/process_group.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <cstdlib>
#include <optional>
#include <regex>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "dist/backends.hpp"
#include "dist/heartbeat.hpp"
#include "recipe/recipe.hpp"
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

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>&, int, int, int,
                                                    std::chrono::milliseconds) {
  throw Error(
      "this lora-train was built without NCCL: rebuild where nccl.h and the CUDA headers "
      "are found (scripts/setup installs them), or set dist.backend: gloo");
}
#endif

Backend backend_of(recipe::DistBackend b, bool cuda) {
  switch (b) {
    case recipe::DistBackend::Auto:
      return cuda ? Backend::Nccl : Backend::Gloo;
    case recipe::DistBackend::Nccl:
      return Backend::Nccl;
    case recipe::DistBackend::Gloo:
      return Backend::Gloo;
  }
  throw Error("unknown dist.backend");
}

namespace {

using Clock = std::chrono::steady_clock;

// First line of an error, without the C++ stack trace torch appends to c10 errors.
std::string short_message(const std::exception& e) {
  const auto* c10 = dynamic_cast<const c10::Error*>(&e);
  std::string m = c10 ? c10->what_without_backtrace() : e.what();
  m = m.substr(0, m.find('\n'));
  // Gloo's messages start with "[file.cc:81] ".
  if (m.starts_with('[') && m.find("] ") != std::string::npos) m = m.substr(m.find("] ") + 2);
  return m;
}

bool is_loopback(const std::string& addr) { return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1"; }

std::shared_ptr<gloo::transport::Device> gloo_device(const DistEnv& env) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname)
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  // All ranks on this machine: talk over loopback rather than whatever the hostname resolves to.
  if (is_loopback(env.master_addr)) return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

// "lorarun/attempt_N/": keys per restart attempt, as torchrun's /worker/attempt_N, so a restarted
// group never reads what the previous attempt left in a store that outlived it.
std::string attempt_prefix(const DistEnv& env) { return fmt::format("lorarun/attempt_{}/", env.restart); }

// One line for a rendezvous that failed: who did not come, and what to check.
std::string rendezvous_failure(const DistEnv& env, std::chrono::seconds waited, const std::exception& e) {
  const std::string master = fmt::format("{}:{}", env.master_addr, env.master_port);
  const std::string why = short_message(e);
  const std::string flags = "--master-addr/--master-port (MASTER_ADDR/MASTER_PORT)";
  std::smatch joined;
  if (env.rank == 0 && std::regex_search(why, joined, std::regex(R"(([0-9]+)/([0-9]+) clients joined)")))
    return fmt::format(
        "rendezvous at {} timed out after {} s with {} of {} ranks joined: start every node (the same "
        "lorarun command with each --node-rank), check that their {} name this node, and that no "
        "firewall blocks port {} (lorarun --rdzv-timeout sets the wait)",
        master, waited.count(), joined[1].str(), joined[2].str(), flags, env.master_port);
  if (env.rank == 0)
    return fmt::format(
        "rank 0 cannot host the rendezvous at {} ({}): choose another --master-port, or check that "
        "--master-addr is this node",
        master, why);
  if (why.find("timed out") != std::string::npos || why.find("Timed out") != std::string::npos)
    return fmt::format(
        "rank {} could not reach the master at {} within {} s: check that node 0 is started, that {} "
        "name it, and that no firewall blocks port {} (lorarun --rdzv-timeout sets the wait)",
        env.rank, master, waited.count(), flags, env.master_port);
  return fmt::format(
      "rank {} could not reach the master at {} ({}): check that node 0 is started, that {} name it, "
      "and that no firewall blocks port {}",
      env.rank, master, why, flags, env.master_port);
}

// A new client connection to the store at the master (for the heartbeats), under `prefix`.
Heartbeat::Connect store_client(const DistEnv& env, std::string prefix) {
  return [env, prefix = std::move(prefix)]() -> c10::intrusive_ptr<c10d::Store> {
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<uint16_t>(env.master_port);
    opts.isServer = false;
    opts.waitWorkers = false;
    opts.timeout = std::chrono::seconds(2);
    return c10::make_intrusive<c10d::PrefixStore>(prefix, c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts));
  };
}

}  // namespace

struct ProcessGroup::Impl {
  DistEnv env;
  Backend backend;
  std::chrono::milliseconds timeout{0};
  c10::Device device{c10::kCPU};
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> pg;
  std::unique_ptr<Heartbeat> heartbeat;  // world size > 1

  // The one error for a collective that failed after `elapsed`: when it timed out, the rank
  // that stopped (from the heartbeats) is named as its cause.
  [[noreturn]] void collective_failed(const std::exception& e, Clock::duration elapsed) const;
};

void ProcessGroup::Impl::collective_failed(const std::exception& e, Clock::duration elapsed) const {
  const std::string why = short_message(e);
  const bool timed_out = why.find("imed out") != std::string::npos || why.find("imeout") != std::string::npos ||
                         elapsed >= timeout * 9 / 10;
  if (!timed_out || !heartbeat)  // (a consequence: the launcher names the rank that failed with a reason)
    throw PeerError(-1, fmt::format("rank {} lost its connection to another rank ({}): that rank stopped first, and "
                                    "its error says why",
                                    env.rank, why));
  const std::string what = fmt::format("rank {}'s all-reduce timed out after {} s (dist.timeout_s)", env.rank,
                                       std::chrono::duration_cast<std::chrono::seconds>(timeout).count());
  const std::optional<Blame> blame = heartbeat->find_stopped_rank();
  if (!blame)
    throw Error(
        fmt::format("{}, and every rank's heartbeat goes on: a rank is slower than dist.timeout_s allows "
                    "(raise it) or the network between ranks is broken ({})",
                    what, why));
  throw PeerError(blame->rank,
                  fmt::format("rank {} {} ({}): {}", blame->rank,
                              blame->silent ? "stopped responding" : "stopped making progress", blame->why, what));
}

ProcessGroup::ProcessGroup(const DistEnv& env, Backend backend, std::chrono::seconds timeout)
    : impl_(std::make_unique<Impl>()) {
  impl_->env = env;
  impl_->backend = backend;
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(timeout);
  impl_->timeout = ms;
  // The rendezvous has a timeout of its own: how long to wait for the master and the other ranks.
  const std::chrono::seconds rdzv = env.rdzv_timeout_s > 0 ? std::chrono::seconds(env.rdzv_timeout_s) : timeout;
  try {
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<uint16_t>(env.master_port);
    opts.isServer = env.rank == 0;
    opts.numWorkers = env.world_size;
    opts.waitWorkers = true;
    opts.timeout = rdzv;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
    tcp->setTimeout(ms);  // from now on the store waits as long as a collective may
    impl_->store = c10::make_intrusive<c10d::PrefixStore>(attempt_prefix(env) + "default_pg", tcp);
  } catch (const std::exception& e) {
    throw Error(rendezvous_failure(env, rdzv, e));
  }
  try {
    if (backend == Backend::Nccl) {
      impl_->device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
      impl_->pg = make_nccl_backend(impl_->store, env.rank, env.world_size, env.local_rank, ms);
    } else {
      auto opts = c10d::ProcessGroupGloo::Options::create(ms);
      opts->devices.push_back(gloo_device(env));
      impl_->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(impl_->store, env.rank, env.world_size, opts);
    }
    if (env.world_size > 1)
      impl_->heartbeat = std::make_unique<Heartbeat>(store_client(env, attempt_prefix(env) + "heartbeat"), env.rank,
                                                     env.world_size, std::chrono::seconds(1));
  } catch (const std::exception& e) {
    // Rank 0 hosts the store: when it goes away (its own rendezvous timed out, say) the others
    // lose the connection here, and rank 0's error is the one that says why.
    const std::string what = e.what();
    if (env.rank != 0 &&
        (what.find("Failed to recv") != std::string::npos || what.find("likely closed") != std::string::npos ||
         what.find("Connection reset") != std::string::npos))
      throw PeerError(0, fmt::format("rank {} lost the rendezvous store on rank 0 at {}:{} while creating the {} "
                                     "process group: rank 0 ended first, and its error says why",
                                     env.rank, env.master_addr, env.master_port, backend_name(backend)));
    throw Error(fmt::format("rank {}: creating the {} process group failed: {}", env.rank, backend_name(backend),
                            short_message(e)));
  }
}

ProcessGroup::~ProcessGroup() = default;

int ProcessGroup::rank() const { return impl_->env.rank; }
int ProcessGroup::size() const { return impl_->env.world_size; }
Backend ProcessGroup::backend() const { return impl_->backend; }

struct ProcessGroup::Pending::Impl {
  c10::intrusive_ptr<c10d::Work> work;
  const ProcessGroup::Impl* group = nullptr;
  Clock::time_point started;
};
ProcessGroup::Pending::Pending(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ProcessGroup::Pending::Pending(Pending&&) noexcept = default;
ProcessGroup::Pending::~Pending() = default;

void ProcessGroup::Pending::wait() {
  try {
    impl_->work->wait();
  } catch (const std::exception& e) {
    impl_->group->collective_failed(e, Clock::now() - impl_->started);
  }
  if (impl_->group->heartbeat) impl_->group->heartbeat->collective_completed();
}

ProcessGroup::Pending ProcessGroup::all_reduce_sum_async(at::Tensor& t) {
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  auto impl = std::make_unique<Pending::Impl>();
  impl->group = impl_.get();
  impl->started = Clock::now();
  if (impl_->heartbeat) impl_->heartbeat->collective_started();
  try {
    impl->work = impl_->pg->allreduce(tensors, opts);
  } catch (const std::exception& e) {
    impl_->collective_failed(e, Clock::now() - impl->started);
  }
  return Pending(std::move(impl));
}

void ProcessGroup::all_reduce_sum(at::Tensor& t) { all_reduce_sum_async(t).wait(); }

ProcessGroup::Pending ProcessGroup::all_gather_async(at::Tensor& out, const at::Tensor& in) {
  const int64_t n = in.numel();
  if (in.dim() != 1 || out.dim() != 1 || out.numel() != n * size() || out.scalar_type() != in.scalar_type())
    throw Error(fmt::format("all_gather: {} elements of {} into {} of {} on {} ranks (a lorarun bug)", n,
                            c10::toString(in.scalar_type()), out.numel(), c10::toString(out.scalar_type()), size()));
  at::Tensor input = in.contiguous();
  auto impl = std::make_unique<Pending::Impl>();
  impl->group = impl_.get();
  impl->started = Clock::now();
  if (impl_->heartbeat) impl_->heartbeat->collective_started();
  try {
    impl->work = impl_->pg->_allgather_base(out, input);  // straight into `out` (no staging copy)
  } catch (const std::exception& e) {
    impl_->collective_failed(e, Clock::now() - impl->started);
  }
  return Pending(std::move(impl));
}

void ProcessGroup::barrier() {
  at::Tensor one = at::ones({1}, at::TensorOptions().device(impl_->device));
  all_reduce_sum(one);
}

}  // namespace lorarun::dist
