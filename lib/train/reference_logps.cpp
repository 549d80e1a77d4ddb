#include "train/reference_logps.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "io/safetensors.hpp"
#include "io/sha256.hpp"
#include "train/agreement.hpp"
#include "train/state.hpp"
#include "util/error.hpp"

namespace lorarun::train {

namespace {
const char* const kFile = "reference_logps.safetensors";
}

ReferenceLogps::ReferenceLogps(int64_t width) : width_(width) {}

// The first 128 bits of the SHA-256 of the example's token ids and labels (each list after its length).
ReferenceLogps::Key ReferenceLogps::key(const data::Example& e) {
  io::Sha256 h;
  for (const std::vector<int32_t>* v : {&e.ids, &e.labels, &e.rejected_ids, &e.rejected_labels}) {
    const uint64_t n = v->size();
    h.update(&n, sizeof n);
    h.update(v->data(), v->size() * sizeof(int32_t));
  }
  const std::string hex = h.hex();
  return {std::stoull(hex.substr(0, 16), nullptr, 16), std::stoull(hex.substr(16, 16), nullptr, 16)};
}

void ReferenceLogps::add(const std::vector<data::Example>& batch, const at::Tensor& logps) {
  const at::Tensor host = logps.detach().to(at::kCPU, at::kDouble).contiguous();
  const auto P = batch.size();
  const double* v = host.data_ptr<double>();
  for (size_t i = 0; i < P; ++i) entries_[key(batch[i])] = {v[i], width_ == 2 ? v[P + i] : 0.0};
}

at::Tensor ReferenceLogps::find(const std::vector<data::Example>& batch, c10::Device device) const {
  const auto P = batch.size();
  std::vector<double> out(static_cast<size_t>(width_) * P);
  for (size_t i = 0; i < P; ++i) {
    const auto it = entries_.find(key(batch[i]));
    if (it == entries_.end()) return {};
    out[i] = it->second[0];
    if (width_ == 2) out[P + i] = it->second[1];
  }
  return at::tensor(out, at::kDouble).to(device, at::kFloat);
}

void ReferenceLogps::gather(const Agreement& agree) {
  // (an entry as float64s: its key in four 32-bit parts, exact, then its log-probs)
  std::vector<double> mine;
  for (const auto& [k, v] : entries_) {
    for (const uint64_t part : {k.hi >> 32, k.hi & 0xffffffffu, k.lo >> 32, k.lo & 0xffffffffu})
      mine.push_back(static_cast<double>(part));
    mine.insert(mine.end(), v.begin(), v.begin() + width_);
  }
  const auto per = static_cast<size_t>(4 + width_);
  for (const std::vector<double>& theirs : agree.gather(mine))
    for (size_t at = 0; at + per <= theirs.size(); at += per) {
      const auto part = [&](size_t j) { return static_cast<uint64_t>(theirs[at + j]); };
      entries_[{part(0) << 32 | part(1), part(2) << 32 | part(3)}] = {theirs[at + 4],
                                                                      width_ == 2 ? theirs[at + 5] : 0.0};
    }
}

void ReferenceLogps::save(const std::string& dir, const nlohmann::json& data) const {
  std::vector<int64_t> keys;
  std::vector<double> logps;
  for (const auto& [k, v] : entries_) {
    keys.push_back(static_cast<int64_t>(k.hi));
    keys.push_back(static_cast<int64_t>(k.lo));
    logps.insert(logps.end(), v.begin(), v.begin() + width_);
  }
  const int64_t n = size();
  io::write_safetensors((std::filesystem::path(dir) / kFile).string(),
                        {{"keys", io::DType::I64, {n, 2}, keys.data(), keys.size() * sizeof(int64_t)},
                         {"logps", io::DType::F64, {n, width_}, logps.data(), logps.size() * sizeof(double)}},
                        {{"data", data.dump()}});
}

std::string ReferenceLogps::load(const std::string& dir, const nlohmann::json& data) {
  const std::string path = (std::filesystem::path(dir) / kFile).string();
  if (!std::filesystem::exists(path)) return fmt::format("{} holds no reference log-probs", dir);
  try {
    const io::SafetensorsFile f(path);
    const auto it = f.metadata().find("data");
    const nlohmann::json saved =
        it == f.metadata().end() ? nlohmann::json() : nlohmann::json::parse(it->second, nullptr, false);
    if (saved != data) {
      const std::string change = data_change(saved, data);
      return fmt::format("the reference log-probs in {} were computed from other data: {}", dir,
                         change.empty() ? "its identity differs" : change);
    }
    const io::TensorInfo* keys = f.find("keys");
    const io::TensorInfo* logps = f.find("logps");
    if (!keys || !logps || keys->dtype != io::DType::I64 || logps->dtype != io::DType::F64 || keys->shape.size() != 2 ||
        keys->shape[1] != 2 || logps->shape != std::vector<int64_t>{keys->shape[0], width_})
      return fmt::format("{} is not a file of reference log-probs", path);
    const auto n = static_cast<size_t>(keys->shape[0]);
    std::vector<int64_t> k(2 * n);
    std::vector<double> v(n * static_cast<size_t>(width_));
    std::memcpy(k.data(), f.bytes(*keys).data(), k.size() * sizeof(int64_t));
    std::memcpy(v.data(), f.bytes(*logps).data(), v.size() * sizeof(double));
    for (const double x : v)
      if (!std::isfinite(x)) return fmt::format("{} holds a non-finite reference log-prob", path);
    entries_.clear();
    for (size_t i = 0; i < n; ++i) {
      const double* e = v.data() + i * static_cast<size_t>(width_);
      entries_[{static_cast<uint64_t>(k[2 * i]), static_cast<uint64_t>(k[2 * i + 1])}] = {e[0],
                                                                                          width_ == 2 ? e[1] : 0.0};
    }
  } catch (const std::exception& e) {  // (a damaged file is recomputed, whatever it holds)
    entries_.clear();
    return e.what();
  }
  return "";
}

}  // namespace lorarun::train
