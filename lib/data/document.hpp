// A document as a source reads it: JSON whose objects keep the key order of the file or the
// collection, as Python's json.loads and pymongo keep it (a chat template's tojson writes them so).
#pragma once
#include <nlohmann/json.hpp>

namespace lorarun::data {

using Document = nlohmann::ordered_json;

}  // namespace lorarun::data
