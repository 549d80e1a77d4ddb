// Which process this is, in a form another process (on this host or another) can check: the
// host, its boot, the pid and the pid's start time, so that a reused pid is not taken for it.
#pragma once
#include <cstdint>
#include <string>

namespace lorarun {

struct ProcessIdentity {
  std::string host;     // gethostname()
  std::string boot_id;  // /proc/sys/kernel/random/boot_id: another boot is another host
  int64_t pid = 0;
  int64_t started = 0;  // /proc/<pid>/stat's starttime (clock ticks after boot)
};

// This host's name ("" when it has none).
std::string host_name();

// This process.
ProcessIdentity this_process();

// Whether `p` is on this host and boot: then alive_here() can tell for sure.
bool on_this_host(const ProcessIdentity& p);

// Whether `p` runs now: on this host and boot, its pid with its start time.
bool alive_here(const ProcessIdentity& p);

// This process's resident memory now (/proc/self/statm; 0 where it cannot be read), and at its
// most so far (getrusage), in MiB.
double resident_mib();
double peak_resident_mib();

// glibc's malloc for a step whose tensors are large (a job of many adapters stacks every adapter's
// micro-batch), unless MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ say otherwise: blocks up to
// 32 MiB from the heap, and freed memory kept there, so each step reuses the last step's pages
// instead of mapping and faulting in fresh ones (glibc's moving threshold maps them anew every step).
void keep_freed_memory_for_reuse();

}  // namespace lorarun
