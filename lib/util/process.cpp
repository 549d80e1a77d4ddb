#include "util/process.hpp"

#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>

namespace lorarun {
namespace {

std::string boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

// Field 22 of /proc/<pid>/stat (after the command name, which is in parentheses and may hold
// spaces); -1 when the process does not exist.
int64_t start_time(int64_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream fields(stat.substr(close + 1));
  std::string field;
  for (int i = 3; i <= 22 && fields >> field; ++i)
    if (i == 22) return std::stoll(field);
  return -1;
}

}  // namespace

std::string host_name() {
  char name[256] = {};
  return gethostname(name, sizeof name - 1) == 0 ? name : "";
}

ProcessIdentity this_process() {
  const int64_t pid = getpid();
  return {host_name(), boot_id(), pid, start_time(pid)};
}

bool on_this_host(const ProcessIdentity& p) { return p.host == host_name() && p.boot_id == boot_id(); }

bool alive_here(const ProcessIdentity& p) { return on_this_host(p) && p.pid > 0 && start_time(p.pid) == p.started; }

double resident_mib() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(statm >> size >> resident)) return 0;
  return static_cast<double>(resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE))) / (1 << 20);
}

double peak_resident_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // (kilobytes)
}

void keep_freed_memory_for_reuse() {
  if (!std::getenv("MALLOC_MMAP_THRESHOLD_")) mallopt(M_MMAP_THRESHOLD, 32 << 20);  // (glibc's largest)
  if (!std::getenv("MALLOC_TRIM_THRESHOLD_")) mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
}

}  // namespace lorarun
