#include "slurm.hpp"

#include <fmt/format.h>
#include <charconv>

#include "util/error.hpp"

namespace lorarun::launch {
namespace {

[[noreturn]] void bad_list(std::string_view list, std::string_view why) {
  throw Error(fmt::format("cannot read the Slurm node list '{}' ({}): pass --master-addr", list, why));
}

// Splits at commas that are not inside [...].
std::vector<std::string_view> split_top(std::string_view s) {
  std::vector<std::string_view> out;
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i <= s.size(); ++i) {
    if (i == s.size() || (s[i] == ',' && depth == 0)) {
      if (i > start) out.push_back(s.substr(start, i - start));
      start = i + 1;
    } else if (s[i] == '[') {
      ++depth;
    } else if (s[i] == ']') {
      --depth;
    }
  }
  return out;
}

long to_number(std::string_view s, std::string_view list) {
  long v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size())
    bad_list(list, fmt::format("'{}' is not a number", s));
  return v;
}

// Appends the hosts of one name that may hold bracket groups: "n[1-2]-ib[01,03]".
void expand_host(std::string_view host, std::string_view list, std::vector<std::string>& out) {
  const size_t open = host.find('[');
  if (open == std::string_view::npos) {
    if (host.find(']') != std::string_view::npos) bad_list(list, "']' without '['");
    out.emplace_back(host);
    return;
  }
  const size_t close = host.find(']', open);
  if (close == std::string_view::npos) bad_list(list, "'[' without ']'");
  const std::string_view prefix = host.substr(0, open), suffix = host.substr(close + 1);
  for (std::string_view item : split_top(host.substr(open + 1, close - open - 1))) {
    const size_t dash = item.find('-');
    const std::string_view lo = item.substr(0, dash);
    const std::string_view hi = dash == std::string_view::npos ? lo : item.substr(dash + 1);
    const long a = to_number(lo, list), b = to_number(hi, list);
    if (b < a || b - a > 100000) bad_list(list, fmt::format("bad range '{}'", item));
    for (long i = a; i <= b; ++i)  // the lower bound's width is the padding: 003-010
      expand_host(fmt::format("{}{:0{}}{}", prefix, i, lo.size(), suffix), list, out);
  }
}

int env_int(const std::function<const char*(const char*)>& env, const char* name, const char* flag, int fallback) {
  const char* v = env(name);
  if (!v || !*v) return fallback;
  int n = 0;
  const std::string_view s(v);
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), n);
  if (ec != std::errc() || end != s.data() + s.size() || n < 0)
    throw Error(fmt::format("{}='{}' is not a count: pass {}", name, s, flag));
  return n;
}

}  // namespace

std::vector<std::string> expand_nodelist(std::string_view list) {
  std::vector<std::string> hosts;
  for (std::string_view host : split_top(list)) expand_host(host, list, hosts);
  return hosts;
}

std::optional<SlurmNode> slurm_node(const std::function<const char*(const char*)>& env) {
  const char* job = env("SLURM_JOB_ID");
  if (!job || !*job) return std::nullopt;
  SlurmNode n;
  n.job_id = job;
  n.nnodes = env_int(env, "SLURM_NNODES", "--nnodes", env_int(env, "SLURM_JOB_NUM_NODES", "--nnodes", 1));
  n.node_rank = env_int(env, "SLURM_NODEID", "--node-rank", 0);
  const char* list = env("SLURM_JOB_NODELIST");
  if (!list || !*list) list = env("SLURM_NODELIST");  // the older name
  if (list && *list) {
    const auto hosts = expand_nodelist(list);
    if (!hosts.empty()) n.first_host = hosts.front();
  }
  return n;
}

}  // namespace lorarun::launch
