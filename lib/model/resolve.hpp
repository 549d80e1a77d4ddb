// model.path: a Hugging Face model directory, or a model id found in the local HF cache.
#pragma once
#include <string>

namespace lorarun::model {

// Returns `path_or_id` if it is a directory; otherwise the snapshot directory of that model id
// in the Hugging Face cache ($HF_HUB_CACHE, $HF_HOME/hub, $XDG_CACHE_HOME/huggingface/hub or
// ~/.cache/huggingface/hub), following refs/main. Nothing is downloaded: a model in neither
// place is a lorarun::Error that says where it looked and how to get the model.
std::string resolve_model_path(const std::string& path_or_id);

}  // namespace lorarun::model
