// TensorBoard event files, written by hand: no protobuf or TensorBoard library. A file is a
// sequence of TFRecords (uint64 length LE, masked CRC-32C of the length, payload, masked CRC-32C
// of the payload), each payload one tensorflow.Event protobuf:
//   Event   {double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5}
//   Summary {repeated Value value = 1}   Value {string tag = 1; float simple_value = 2}
// The first event of a file holds file_version "brain.Event:2"; each scalar is an event of its own.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "io/files.hpp"

namespace lorarun::track {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as TFRecord framing uses.
uint32_t crc32c(std::string_view data);

// TFRecord's masked CRC: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t masked_crc32c(std::string_view data);

// One scalar of a step: a tag ("train/loss") and its value (stored as float32, as TensorBoard does).
struct Scalar {
  std::string tag;
  double value = 0;
};

// One events file, events.out.tfevents.<unix seconds>.<hostname>.<pid>.<n> under a directory.
class TensorBoardWriter {
 public:
  // Creates `dir` and a new events file in it, and writes the file_version event. What earlier
  // files there hold goes as metrics.jsonl's rows go: a fresh run (`resumed_after` empty) removes
  // them; a run resumed after step *resumed_after cuts them back to the events of that step and
  // before (what an interrupted process logged later is logged again), so every reader shows each
  // step once. Throws lorarun::Error when a file cannot be read or written.
  explicit TensorBoardWriter(const std::string& dir, std::optional<int64_t> resumed_after = std::nullopt);

  // One event per scalar at `step`, then a flush, so a live TensorBoard sees them at once.
  // Throws lorarun::Error when the write fails.
  void scalars(int64_t step, const std::vector<Scalar>& values);

  // The events file's path.
  const std::string& path() const { return path_; }

 private:
  void write_event(const std::string& event);
  void write(const std::string& records);

  std::string path_;
  io::OutFile out_;
};

}  // namespace lorarun::track
