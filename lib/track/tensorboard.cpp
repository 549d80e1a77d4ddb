#include "track/tensorboard.hpp"

#include <fmt/format.h>
#include <unistd.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <system_error>

#include "io/files.hpp"
#include "util/error.hpp"

namespace lorarun::track {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kFileVersion = "brain.Event:2";

// Protobuf wire types.
constexpr int kVarint = 0, kFixed64 = 1, kBytes = 2, kFixed32 = 5;

// The 256-entry table of CRC-32C for one byte, reflected.
std::array<uint32_t, 256> crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    table[i] = c;
  }
  return table;
}

// `bits` as `bytes` little-endian bytes.
void put_le(std::string& out, uint64_t bits, int bytes) {
  for (int i = 0; i < bytes; ++i) out += static_cast<char>((bits >> (8 * i)) & 0xff);
}

// A base-128 varint, low groups first (negative int64s as their 10-byte two's complement).
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7f) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}

// A field's key: its number and wire type.
void put_key(std::string& out, int field, int wire) { put_varint(out, static_cast<uint64_t>(field) << 3 | wire); }

// A length-delimited field: a string or an embedded message.
void put_bytes(std::string& out, int field, std::string_view bytes) {
  put_key(out, field, kBytes);
  put_varint(out, bytes.size());
  out += bytes;
}

// An Event's wall_time (seconds since the epoch, double, field 1) and step (int64, field 2).
std::string event_head(int64_t step) {
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  uint64_t bits = 0;
  std::memcpy(&bits, &now, sizeof bits);
  std::string event;
  put_key(event, 1, kFixed64);
  put_le(event, bits, 8);
  put_key(event, 2, kVarint);
  put_varint(event, static_cast<uint64_t>(step));
  return event;
}

// The first event of a file: Event{wall_time, step 0, file_version}.
std::string version_event() {
  std::string event = event_head(0);
  put_bytes(event, 3, kFileVersion);
  return event;
}

// Event{wall_time, step, summary: Summary{value: [Value{tag, simple_value}]}}.
std::string scalar_event(int64_t step, const Scalar& s) {
  const auto f = static_cast<float>(s.value);
  uint32_t bits = 0;
  std::memcpy(&bits, &f, sizeof bits);
  std::string value;
  put_bytes(value, 1, s.tag);
  put_key(value, 2, kFixed32);
  put_le(value, bits, 4);
  std::string summary;
  put_bytes(summary, 1, value);
  std::string event = event_head(step);
  put_bytes(event, 5, summary);
  return event;
}

// One TFRecord: length, its masked CRC, the payload, its masked CRC.
std::string tf_record(std::string_view payload) {
  std::string length;
  put_le(length, payload.size(), 8);
  std::string out = length;
  put_le(out, masked_crc32c(length), 4);
  out += payload;
  put_le(out, masked_crc32c(payload), 4);
  return out;
}

// The little-endian number in the `bytes` bytes at `at` of `s`.
uint64_t get_le(std::string_view s, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(s[at + i])) << (8 * i);
  return v;
}

// Reads the varint at `at` of `s` into `v` and moves `at` past it; false when it runs past the end.
bool get_varint(std::string_view s, size_t& at, uint64_t& v) {
  v = 0;
  for (int shift = 0; at < s.size() && shift < 64; shift += 7) {
    const auto byte = static_cast<unsigned char>(s[at++]);
    v |= static_cast<uint64_t>(byte & 0x7f) << shift;
    if (!(byte & 0x80)) return true;
  }
  return false;
}

// The step of an Event (0 when it has none), walking its fields; empty when it is not a message.
std::optional<int64_t> event_step(std::string_view event) {
  int64_t step = 0;
  for (size_t at = 0; at < event.size();) {
    uint64_t key = 0, v = 0;
    if (!get_varint(event, at, key)) return std::nullopt;
    const int wire = static_cast<int>(key & 7);
    if (wire == kVarint) {
      if (!get_varint(event, at, v)) return std::nullopt;
      if (key >> 3 == 2) step = static_cast<int64_t>(v);
    } else if (wire == kBytes) {
      if (!get_varint(event, at, v) || v > event.size() - at) return std::nullopt;
      at += v;
    } else if (wire == kFixed64 || wire == kFixed32) {
      at += wire == kFixed64 ? 8 : 4;
    } else {
      return std::nullopt;
    }
    if (at > event.size()) return std::nullopt;
  }
  return step;
}

// The TFRecords of `data` whose events are of `last_step` or before, verbatim. Stops at a record cut
// short, failing its CRC or not an Event: the end of a file whose process was killed mid-write.
std::string records_through(std::string_view data, int64_t last_step) {
  std::string kept;
  for (size_t at = 0; data.size() - at >= 16;) {
    const uint64_t n = get_le(data, at, 8);
    if (get_le(data, at + 8, 4) != masked_crc32c(data.substr(at, 8)) || n > data.size() - at - 16) break;
    const std::string_view event = data.substr(at + 12, n);
    const std::optional<int64_t> step = event_step(event);
    if (get_le(data, at + 12 + n, 4) != masked_crc32c(event) || !step) break;
    if (*step <= last_step) kept.append(data.substr(at, 16 + n));
    at += 16 + n;
  }
  return kept;
}

// The events files in `dir`, in name order (TensorBoard's order).
std::vector<fs::path> events_files(const fs::path& dir) {
  std::vector<fs::path> files;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().filename().string().find("tfevents") != std::string::npos) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  return files;
}

// A resumed run: each earlier events file keeps the events of `last_step` and before (rewritten
// whole, atomically, when it held more).
void trim_events_files(const fs::path& dir, int64_t last_step) {
  for (const fs::path& file : events_files(dir)) {
    const std::string data = io::read_file(file.string());
    const std::string kept = records_through(data, last_step);
    if (kept.size() != data.size()) io::write_file_atomic(file.string(), kept);
  }
}

// This machine's name, for the file name TensorBoard expects.
std::string hostname() {
  std::array<char, 256> name{};
  if (gethostname(name.data(), name.size() - 1) != 0) return "localhost";
  return name.data();
}

// events.out.tfevents.<unix seconds>.<hostname>.<pid>.<n>: n counts the files this process opened.
std::string events_file_name() {
  static std::atomic<int> opened{0};
  return fmt::format("events.out.tfevents.{}.{}.{}.{}", static_cast<long long>(std::time(nullptr)), hostname(),
                     getpid(), opened++);
}

// A fresh run: removes the events files in `dir` (an earlier run's).
void remove_events_files(const fs::path& dir) {
  for (const fs::path& file : events_files(dir)) {
    std::error_code ec;
    if (!fs::remove(file, ec) && ec)
      throw Error(
          fmt::format("cannot remove the earlier run's TensorBoard file {}: {}; remove it by hand or set "
                      "track.tensorboard: false",
                      file.string(), ec.message()));
  }
}

}  // namespace

uint32_t crc32c(std::string_view data) {
  static const std::array<uint32_t, 256> table = crc32c_table();
  uint32_t c = 0xFFFFFFFFu;
  for (const char ch : data) c = table[(c ^ static_cast<unsigned char>(ch)) & 0xff] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(std::string_view data) {
  const uint32_t crc = crc32c(data);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir, std::optional<int64_t> resumed_after) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw Error(
        fmt::format("cannot create the TensorBoard directory {}: {}; make checkpoint.output_dir writable or "
                    "set track.tensorboard: false",
                    dir, ec.message()));
  if (resumed_after)
    trim_events_files(dir, *resumed_after);
  else
    remove_events_files(dir);
  path_ = (fs::path(dir) / events_file_name()).string();
  try {
    out_ = io::OutFile(path_, io::OutFile::Mode::Truncate);
  } catch (const ConfigError&) {
    throw;
  } catch (const Error& e) {
    throw Error(fmt::format("{}; make checkpoint.output_dir writable or set track.tensorboard: false", e.what()));
  }
  write_event(version_event());
}

void TensorBoardWriter::scalars(int64_t step, const std::vector<Scalar>& values) {
  std::string records;  // one write: a live TensorBoard sees them at once
  for (const Scalar& s : values) records += tf_record(scalar_event(step, s));
  write(records);
}

void TensorBoardWriter::write_event(const std::string& event) { write(tf_record(event)); }

// A failed write (disk full, file gone) is an error.
void TensorBoardWriter::write(const std::string& records) {
  try {
    out_.write(records);
  } catch (const Error& e) {
    throw Error(fmt::format("{} (disk full?); free space or set track.tensorboard: false", e.what()));
  }
}

}  // namespace lorarun::track
