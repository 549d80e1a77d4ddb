#include "dist/env.hpp"

#include <fmt/format.h>
#include <cstdlib>

#include "util/error.hpp"

namespace lorarun::dist {
namespace {

int int_var(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0 || x > 1 << 24)
    throw Error(
        fmt::format("{}='{}' is not a non-negative integer: launch with lorarun or set it "
                    "to a number",
                    name, v));
  return static_cast<int>(x);
}

}  // namespace

DistEnv DistEnv::from_environment() {
  DistEnv e;
  e.launched = std::getenv("RANK") != nullptr || std::getenv("WORLD_SIZE") != nullptr;
  e.rank = int_var("RANK", 0);
  e.world_size = int_var("WORLD_SIZE", 1);
  e.local_rank = int_var("LOCAL_RANK", e.rank);
  e.local_world_size = int_var("LOCAL_WORLD_SIZE", e.world_size);
  if (const char* a = std::getenv("MASTER_ADDR"); a && *a) e.master_addr = a;
  // A world of one started by hand binds any free port (as torchrun --standalone picks one), so
  // two single-rank runs on one machine never collide on 29500.
  e.master_port = int_var("MASTER_PORT", e.world_size == 1 ? 0 : 29500);
  e.rdzv_timeout_s = int_var("LORARUN_RDZV_TIMEOUT", 0);
  e.restart = int_var("TORCHELASTIC_RESTART_COUNT", 0);
  if (e.world_size < 1) throw Error("WORLD_SIZE=0: it must be at least 1");
  if (e.rank >= e.world_size)
    throw Error(
        fmt::format("RANK={} is not below WORLD_SIZE={}: each rank must be in "
                    "[0, WORLD_SIZE)",
                    e.rank, e.world_size));
  if (e.local_rank >= e.local_world_size)
    throw Error(fmt::format("LOCAL_RANK={} is not below LOCAL_WORLD_SIZE={}", e.local_rank, e.local_world_size));
  if ((e.master_port < 1 && !(e.master_port == 0 && e.world_size == 1)) || e.master_port > 65535)
    throw Error(fmt::format("MASTER_PORT={} is not a TCP port (1-65535)", e.master_port));
  return e;
}

}  // namespace lorarun::dist
