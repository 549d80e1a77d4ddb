// GridFS upload and download rate of lib/track/artifacts (checkpoint.store: mongodb) for one
// directory: `store_bench URI DB DIR` uploads DIR as an artifact of a made-up run, pulls it back
// (sha256 checked), removes it and prints one JSON line {bytes, upload_s, upload_mb_s,
// download_s, download_mb_s, start_rss_mb, upload_peak_rss_mb, download_peak_rss_mb} (peak
// resident memory of the process before and after each: the file is streamed, never held). Make DIR with e.g. `head -c
// 100M /dev/urandom > DIR/blob`.
#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <filesystem>

#include "track/artifacts.hpp"

static double peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: store_bench URI DB DIR\n");
    return 2;
  }
  using Clock = std::chrono::steady_clock;
  try {
    const double start_rss = peak_rss_mb();
    lorarun::track::ArtifactStore store(argv[1], argv[2], std::chrono::seconds(10));
    const std::string run = "0123456789abcdef01234567";
    const auto t0 = Clock::now();
    const auto up = store.upload(run, "epoch_0", argv[3]);
    const auto t1 = Clock::now();
    const double up_rss = peak_rss_mb();
    const std::string back = std::filesystem::temp_directory_path() / fmt::format("store_bench_{}", ::getpid());
    store.download(run, "epoch_0", up, back);
    const auto t2 = Clock::now();
    store.remove(run);
    std::filesystem::remove_all(back);
    int64_t bytes = 0;
    for (const auto& f : up) bytes += f.bytes;
    const double us = std::chrono::duration<double>(t1 - t0).count(),
                 ds = std::chrono::duration<double>(t2 - t1).count();
    fmt::print(
        "{{\"bytes\": {}, \"upload_s\": {:.3f}, \"upload_mb_s\": {:.1f}, \"download_s\": {:.3f}, "
        "\"download_mb_s\": {:.1f}, \"start_rss_mb\": {:.1f}, \"upload_peak_rss_mb\": {:.1f}, "
        "\"download_peak_rss_mb\": {:.1f}}}\n",
        bytes, us, bytes / 1e6 / us, ds, bytes / 1e6 / ds, start_rss, up_rss, peak_rss_mb());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "store_bench: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
