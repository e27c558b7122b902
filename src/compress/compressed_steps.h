// compressed_allreduce as the steps of a call already running on the context's engine: how
// the reducer reduces a bucket (several tensors, one queued call) without a queue of its own.
#pragma once

#include <span>

#include "compress/codecs.h"
#include "core/context_impl.h"
#include "gradsync/compress.h"

namespace gradsync::compress {

// As compressed_allreduce (see compress.h); false if the step was skipped on every rank.
// `state`: error feedback's state for `data`, kept by the caller; null: the codec's own under
// the tensor's name.
bool compressed_allreduce_steps(CallSteps& steps, std::span<float> data, Codec& codec,
                                const Tensor& tensor, ReduceOp op, NonFinite non_finite,
                                const FeedbackState* state = nullptr);
// The bucket form; `parts` must tile `data` (the caller checked). PowerSGD goes part by part
// (with its own state); every other codec reduces `data` whole under the bucket's name.
bool compressed_allreduce_steps(CallSteps& steps, std::span<float> data, Codec& codec,
                                const Tensor& bucket, std::span<const TensorSlice> parts,
                                ReduceOp op, NonFinite non_finite,
                                const FeedbackState* state = nullptr);

}  // namespace gradsync::compress
