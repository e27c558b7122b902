// compressed_allreduce as the steps of a call already running on the context's engine: how
// the reducer reduces a bucket (several tensors, one queued call) without a queue of its own.
#pragma once

#include <span>

#include "core/context_impl.h"
#include "gradsync/compress.h"

namespace gradsync::compress {

// As compressed_allreduce (see compress.h); false if the step was skipped on every rank.
bool compressed_allreduce_steps(CallSteps& steps, std::span<float> data, Codec& codec,
                                const Tensor& tensor, ReduceOp op, NonFinite non_finite);
// The bucket form; `parts` must tile `data` (the caller checked).
bool compressed_allreduce_steps(CallSteps& steps, std::span<float> data, Codec& codec,
                                const Tensor& bucket, std::span<const TensorSlice> parts,
                                ReduceOp op, NonFinite non_finite);

}  // namespace gradsync::compress
