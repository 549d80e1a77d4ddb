// The checkpoint policy (train/checkpointer.hpp): which epoch adapters a run keeps, from the
// recipe's checkpoint.epochs_to_save and save_last_epoch_only.
#include <catch2/catch.hpp>
#include <vector>

#include "recipe/recipe.hpp"
#include "train/checkpointer.hpp"

using lorarun::recipe::CheckpointSection;
using lorarun::recipe::EpochsToSave;
using lorarun::train::epochs_kept;
using lorarun::train::save_after_epoch;

TEST_CASE("the checkpoint policy: the epochs kept by epochs_to_save and save_last_epoch_only") {
  CheckpointSection c;  // all, by default
  CHECK(epochs_kept(c, 4) == std::vector<int>{0, 1, 2, 3});
  CHECK(epochs_kept(c, 1) == std::vector<int>{0});
  CHECK(epochs_kept(c, 0).empty());
  c.epochs_to_save = {EpochsToSave::Mode::None, {}};
  CHECK(epochs_kept(c, 4).empty());
  c.epochs_to_save = {EpochsToSave::Mode::List, {3, 0}};
  CHECK(epochs_kept(c, 4) == std::vector<int>{0, 3});
  c.epochs_to_save = {EpochsToSave::Mode::List, {2, 0}};
  CHECK(epochs_kept(c, 3) == std::vector<int>{0, 2});
  CHECK(save_after_epoch(c, 0, 3));
  CHECK_FALSE(save_after_epoch(c, 1, 3));
  CHECK(save_after_epoch(c, 2, 3));
  // An early stop: the epochs kept of those that ran.
  CHECK(epochs_kept(c, 2) == std::vector<int>{0});
  // save_last_epoch_only wins over the list.
  c.save_last_epoch_only = true;
  CHECK(epochs_kept(c, 3) == std::vector<int>{2});
  CHECK_FALSE(save_after_epoch(c, 0, 3));
  CHECK(save_after_epoch(c, 2, 3));
}
