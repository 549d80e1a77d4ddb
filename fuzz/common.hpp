// Shared by the fuzz harnesses: the input as a file, and the one rule for exceptions.
#pragma once
#include <unistd.h>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <new>
#include <string>
#include <string_view>
#include <typeinfo>

#include "util/error.hpp"

namespace lorarun::fuzz {

// Aborts with a message; libFuzzer saves the input as a crash artifact.
[[noreturn]] inline void finding(const std::string& what) {
  std::fprintf(stderr, "\n*** FINDING: %s\n", what.c_str());
  std::abort();
}

inline std::string own_scratch_dir() { return "/dev/shm/lorarun-fuzz-" + std::to_string(::getpid()); }

// A scratch path in RAM (/dev/shm), so that writing each input costs no disk I/O. The
// directory is $LORARUN_FUZZ_SCRATCH (scripts/fuzz sets and removes it) or one per process,
// removed at exit (a crash leaves it behind).
inline std::string scratch_path(std::string_view name) {
  static const std::string dir = [] {
    const char* env = std::getenv("LORARUN_FUZZ_SCRATCH");
    std::string d = env && *env ? env : own_scratch_dir();
    if (!(env && *env))
      std::atexit([] {
        std::error_code ec;
        std::filesystem::remove_all(own_scratch_dir(), ec);
      });
    std::error_code ec;
    std::filesystem::create_directories(d, ec);
    if (ec) finding("cannot create the scratch directory " + d + ": " + ec.message());
    return d;
  }();
  return dir + "/" + std::string(name);
}

inline void write_file(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) finding("cannot write " + path);
}

// Runs f; lorarun::Error (bad input, reported to the user) and std::bad_alloc are the only
// acceptable failures. Anything else escaping is a finding: print its type and abort, which
// libFuzzer records as a crash with the input.
template <class F>
bool expect_only_lorarun_errors(F&& f) {
  try {
    f();
    return true;
  } catch (const lorarun::Error&) {
    return false;
  } catch (const std::bad_alloc&) {
    return false;
  } catch (const std::exception& e) {
    finding(std::string(typeid(e).name()) + " escaped instead of lorarun::Error: " + e.what());
  } catch (...) {
    finding("a non-std exception escaped");
  }
}

}  // namespace lorarun::fuzz
