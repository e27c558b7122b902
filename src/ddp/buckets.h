// How the Reducer groups gradients into buckets, shared with the advisor's model of a step
// so that the two never disagree on the calls a step makes.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

namespace gradsync::ddp {

// Buckets over float32 tensors of `counts` floats, in the order they become ready: positions
// into `counts`, per bucket. The first bucket holds up to first_bucket_bytes, the others up to
// bucket_bytes. A tensor of at least half the cap gets a bucket of its own: no second one fits
// beside it, and sharing with a smaller one would hold its all-reduce until that one is ready
// too (or the smaller one's until it is), to save one call's latency. A timeline of the
// benchmarks' MLP showed a large weight held back this way, its whole all-reduce after
// backward (docs/performance-notes.md).
std::vector<std::vector<std::size_t>> assign_buckets(std::span<const std::size_t> counts,
                                                     std::size_t first_bucket_bytes,
                                                     std::size_t bucket_bytes);

}  // namespace gradsync::ddp
