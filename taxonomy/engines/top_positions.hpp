#pragma once
// A streamed top-k: the w positions of largest value (ties: lower position first), ascending, over
// values that arrive in blocks of ascending positions, so the values are never held whole (the
// routing transformer's balanced clusters select over an affinity matrix computed a block of
// tokens at a time). A block's values at or above the bar join the candidate list
// (tiles::positions_at_least); when the list holds more than w + kSlack it is cut to between w and
// w + kSlack/2 of its best and the bar rises past the cut (a later value equal to it loses to the
// at least w kept); the last cut is exact. Values hold no NaN. Each of the caller's buffers holds
// capacity(w, largest block, positions in all) entries (the list never holds more than w + kSlack
// before a block, nor more positions than there are); the scratch pair may be shared by lists used
// one at a time.
#include <cstdint>

namespace xfb {

class TopPositions {
 public:
  static constexpr std::int64_t kSlack = 128;
  static std::int64_t capacity(std::int64_t w, std::int64_t block, std::int64_t n) {
    return n < w + kSlack + block ? n : w + kSlack + block;
  }

  void reset(std::int64_t w, std::int32_t* positions, float* values, std::int32_t* scratch_indices,
             float* scratch_values);
  // values[j] is the value of position first + j (j < count); first is past every earlier block.
  void add(const float* values, std::int64_t count, std::int64_t first);
  // The min(w, positions seen) members, ascending.
  void finish(std::int32_t* members);

 private:
  void cut(std::int64_t keep);
  std::int64_t w_ = 0, count_ = 0;
  std::int32_t *positions_ = nullptr, *scratch_indices_ = nullptr;
  float *values_ = nullptr, *scratch_values_ = nullptr;
  std::int32_t least_ = 0;  // every listed key is at least this
  float bar_ = 0.0f;        // values below it cannot be members
};

}  // namespace xfb
