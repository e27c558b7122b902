// ZeRO 3's order of gathers in ShardedDataParallel, shared with the advisor's model of a step
// so that the two never disagree on the calls a step makes.
#pragma once

#include <algorithm>
#include <cstddef>

namespace gradsync::ddp::zero3 {

// A step uses its units in order: forward 0 .. L-1 at uses 0 .. L-1, then backward L-2 .. 0 at
// uses L .. 2L-2 (the last unit's backward is its forward's use).
struct Use {
  std::size_t unit;
  bool backward;
};
inline std::size_t last_use(std::size_t units) {
  return 2 * (units - 1);
}
inline std::size_t use_of(std::size_t unit, bool backward, std::size_t units) {
  return backward ? last_use(units) - unit : unit;
}
inline Use use_at(std::size_t use, std::size_t units) {
  return use < units ? Use{use, false} : Use{last_use(units) - use, true};
}

// The last prefetch_depth + 1 units stay whole from their forward to their backward: forward
// would queue their second gathers itself, which could hide only behind the units after them,
// and the copies kept take the place of the prefetched ones.
inline bool kept_for_backward(std::size_t unit, std::size_t units, std::size_t prefetch_depth) {
  return unit + prefetch_depth + 1 >= units;
}

// How many units, the first in forward order, the step queues the gathers of as their shards
// step: those the first acquire would queue (itself and the prefetch_depth after it), none
// where nothing is prefetched.
inline std::size_t gathered_by_step(std::size_t prefetch_depth) {
  return prefetch_depth == 0 ? 0 : prefetch_depth + 1;
}

// Reduce-scatters left in flight after a unit's is queued: as many as are prefetched, so the
// oldest was queued ahead of the gather the next acquire waits for, and waiting for it costs
// nothing.
inline std::size_t reduce_scatters_in_flight(std::size_t prefetch_depth) {
  return std::max<std::size_t>(1, prefetch_depth);
}

}  // namespace gradsync::ddp::zero3
