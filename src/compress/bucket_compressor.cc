// BucketCompressor: compressed all-reduce of buckets that another framework builds and may
// regroup (torch DDP), with error feedback's state kept per parameter rather than per bucket.
#include <algorithm>
#include <map>
#include <optional>

#include "compress/compressed_steps.h"
#include "gradsync/bytes.h"
#include "gradsync/compress.h"

namespace gradsync::compress {

struct BucketCompressor::State {
  std::unique_ptr<Codec> codec;
  ErrorFeedback* feedback = nullptr;  // the codec, if error feedback: its state is ours
  bool whole_buckets = false;
  // Per parameter: error feedback's residual and momentum (empty without momentum).
  struct Held {
    std::vector<float> residual, momentum;
  };
  std::map<std::string, Held> held;

  Held& held_of(const TensorSlice& part) {
    Held& h = held[part.tensor.name];
    if (h.residual.size() != part.count) {  // new, or a parameter whose size changed
      h.residual.assign(part.count, 0.0f);
      h.momentum.assign(feedback->has_momentum() ? part.count : 0, 0.0f);
    }
    return h;
  }

  // Runs on the engine: the bucket's all-reduces, as steps of one call.
  void reduce(CallSteps& steps, std::span<float> data, const std::vector<TensorSlice>& parts,
              ReduceOp op, NonFinite non_finite) {
    if (whole_buckets) {
      // The whole bucket goes in one call: its feedback state is assembled from the
      // parameters' and handed back to them afterwards.
      std::vector<float> residual, momentum;
      if (feedback) {
        residual.resize(data.size());
        if (feedback->has_momentum()) momentum.resize(data.size());
        for (const auto& p : parts) {
          Held& h = held_of(p);
          std::copy(h.residual.begin(), h.residual.end(),
                    residual.begin() + static_cast<std::ptrdiff_t>(p.offset));
          if (!momentum.empty()) {
            std::copy(h.momentum.begin(), h.momentum.end(),
                      momentum.begin() + static_cast<std::ptrdiff_t>(p.offset));
          }
        }
      }
      const FeedbackState state{residual, momentum};
      if (!compressed_allreduce_steps(steps, data, *codec, bucket_name(parts), parts, op,
                                      non_finite, feedback ? &state : nullptr)) {
        steps.mark_skipped();
        return;  // a skipped step leaves the state as it was
      }
      for (const auto& p : parts) {
        if (!feedback) break;
        Held& h = held[p.tensor.name];
        std::copy_n(residual.begin() + static_cast<std::ptrdiff_t>(p.offset), p.count,
                    h.residual.begin());
        if (!momentum.empty()) {
          std::copy_n(momentum.begin() + static_cast<std::ptrdiff_t>(p.offset), p.count,
                      h.momentum.begin());
        }
      }
      return;
    }
    for (const auto& p : parts) {
      std::optional<FeedbackState> state;
      if (feedback) {
        Held& h = held_of(p);
        state = FeedbackState{h.residual, h.momentum};
      }
      if (!compressed_allreduce_steps(steps, data.subspan(p.offset, p.count), *codec, p.tensor, op,
                                      non_finite, state ? &*state : nullptr)) {
        steps.mark_skipped();
      }
    }
  }

  // The name whole-bucket state the codec keeps itself goes under (top-k's warm-up count):
  // its parameters', so a regrouped bucket is a new one.
  static std::string bucket_name(const std::vector<TensorSlice>& parts) {
    std::string name = "bucket(";
    for (std::size_t i = 0; i < parts.size(); ++i) name += (i ? "," : "") + parts[i].tensor.name;
    return name + ")";
  }
};

BucketCompressor::BucketCompressor(std::string_view spec) : s_(std::make_unique<State>()) {
  s_->codec = make_codec(spec);
  s_->feedback = dynamic_cast<ErrorFeedback*>(s_->codec.get());
  s_->whole_buckets = s_->codec->traits().whole_buckets;
}

BucketCompressor::~BucketCompressor() = default;

const Codec& BucketCompressor::codec() const {
  return *s_->codec;
}

Work BucketCompressor::allreduce_async(Context& ctx, std::span<float> data,
                                       std::span<const TensorSlice> parts, ReduceOp op,
                                       NonFinite non_finite) {
  std::vector<TensorSlice> tiles(parts.begin(), parts.end());
  std::sort(tiles.begin(), tiles.end(),
            [](const TensorSlice& a, const TensorSlice& b) { return a.offset < b.offset; });
  std::size_t at = 0;
  for (const auto& p : tiles) {
    if (p.offset != at) {
      throw Error(ErrorKind::kInvalidArgument,
                  "parameter '" + p.tensor.name + "' starts at float " + std::to_string(p.offset) +
                      " of its bucket, not at " + std::to_string(at) +
                      ": the parts must tile the bucket",
                  ctx.rank(), Error::kNoPeer, "compressed allreduce");
    }
    at += p.count;
  }
  if (at != data.size()) {
    throw Error(ErrorKind::kInvalidArgument,
                "the parts cover " + std::to_string(at) + " floats of a bucket of " +
                    std::to_string(data.size()),
                ctx.rank(), Error::kNoPeer, "compressed allreduce");
  }
  const collectives::CallSignature call{0,
                                        collectives::CollectiveKind::kCompressedAllreduce,
                                        DataType::kFloat32,
                                        op,
                                        Algorithm::kAuto,
                                        -1,
                                        data.size()};
  State& s = *s_;
  return detail::ContextAccess::impl(ctx).submit_steps(
      call,
      [&s, data, tiles = std::move(tiles), op, non_finite](CallSteps& steps) {
        s.reduce(steps, data, tiles, op, non_finite);
      },
      false);
}

// Layout: the codec's spec and state, then per parameter its name, residual and momentum.
std::vector<std::uint8_t> BucketCompressor::save_state() const {
  ByteWriter w("GSBC", 1);
  w.string(s_->codec->spec());
  w.bytes(s_->codec->save_state());
  w.put<std::uint64_t>(s_->held.size());
  for (const auto& [name, h] : s_->held) {
    w.string(name);
    w.floats(h.residual);
    w.floats(h.momentum);
  }
  return w.take();
}

void BucketCompressor::load_state(std::span<const std::uint8_t> state) {
  ByteReader r(state, "GSBC", 1, "bucket compressor state");
  const std::string spec = r.string();
  if (spec != s_->codec->spec()) {
    r.fail("written by codec '" + spec + "'; this compressor is '" + s_->codec->spec() + "'");
  }
  const auto codec_state = r.bytes();
  std::map<std::string, State::Held> held;
  const auto n = r.get<std::uint64_t>();
  for (std::uint64_t i = 0; i < n; ++i) {
    std::string name = r.key_after(held);
    State::Held h;
    h.residual = r.floats();
    h.momentum = r.floats();
    held[std::move(name)] = std::move(h);
  }
  r.finish();
  s_->codec->load_state(codec_state);  // may throw: nothing of ours replaced yet
  s_->held = std::move(held);
}

std::span<const float> BucketCompressor::held_back(const std::string& parameter) const {
  if (!s_->feedback) return s_->codec->held_back(parameter);
  auto it = s_->held.find(parameter);
  if (it == s_->held.end()) return {};
  return it->second.residual;
}

}  // namespace gradsync::compress
