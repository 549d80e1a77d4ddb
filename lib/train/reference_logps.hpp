// preference.precompute_reference: the reference's summed log-probs of each training example's
// completions (DPO: the chosen's and the rejected's; KTO: its completion's), computed once before
// training and found again by the example's tokens, so that neither the epoch's order, the rank
// that reads it nor a later epoch matters. Kept in the resumable state's directory.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_map>
#include <vector>

#include "data/example.hpp"

namespace lorarun::train {

class Agreement;

class ReferenceLogps {
 public:
  // `width` log-probs an example: 2 for pairs (chosen, rejected), 1 for KTO's single completions.
  explicit ReferenceLogps(int64_t width);

  // The examples of a batch and their reference log-probs `logps` [width x P], in PairBatch's row
  // order (every chosen completion, then every rejected one).
  void add(const std::vector<data::Example>& batch, const at::Tensor& logps);
  // Their log-probs in that order, float32 on `device`; undefined when one of them has none here.
  at::Tensor find(const std::vector<data::Example>& batch, c10::Device device) const;
  // Every rank's entries, on each rank.
  void gather(const Agreement& agree);
  int64_t size() const { return static_cast<int64_t>(entries_.size()); }
  void clear() { entries_.clear(); }

  // <dir>/reference_logps.safetensors, naming `data` (the selection's identity) it was computed from.
  void save(const std::string& dir, const nlohmann::json& data) const;
  // Its entries from `dir`'s file. "" when read; else why nothing was read: there is none, or it
  // was computed from other data than `data` (in words), or it is not a file of this kind.
  std::string load(const std::string& dir, const nlohmann::json& data);

 private:
  struct Key {
    uint64_t hi = 0, lo = 0;
    bool operator==(const Key&) const = default;
  };
  struct Hash {
    size_t operator()(const Key& k) const { return static_cast<size_t>(k.lo); }
  };
  static Key key(const data::Example& e);

  int64_t width_;
  std::unordered_map<Key, std::array<double, 2>, Hash> entries_;
};

}  // namespace lorarun::train
