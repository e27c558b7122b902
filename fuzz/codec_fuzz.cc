// libFuzzer target for the codec payload decoders and the error-feedback state loader: any
// bytes are either decoded into exactly the requested floats or refused with gradsync::Error,
// never read out of bounds (ASan) or crash.
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "gradsync/compress.h"
#include "gradsync/error.h"

namespace {
const char* const kSpecs[] = {"none",
                              "fp16",
                              "bf16",
                              "int8:ef=0,block=1",
                              "int8:ef=0,block=7",
                              "int8:ef=0,block=256",
                              "qsgd:levels=15,block=8",
                              "topk:ratio=0.1",
                              "randomk:ratio=0.25",
                              "threshold:rel=0.5",
                              "sign",
                              "sign:block=8",
                              "powersgd:rank=2"};
// Codecs with state to load: error feedback, step counters, PowerSGD's residuals and Qs.
const char* const kStateful[] = {"int8:block=16", "qsgd", "randomk:ratio=0.5,ef=0",
                                 "powersgd:rank=2", "topk:ratio=0.1,warmup=5,momentum=0.9"};
}  // namespace

// Input: byte 0 picks the codec (bit 6: decode_add instead of decode), bytes 1-2 the element
// count (< 65536), the rest is the payload (or, for byte 0 >= 128, a state to load).
extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 3) return 0;
  const std::span<const std::uint8_t> rest(data + 3, size - 3);
  try {
    if (data[0] >= 128) {
      auto codec = gradsync::compress::make_codec(kStateful[data[0] % std::size(kStateful)]);
      codec->load_state(rest);
      // A state that loaded re-saves to the same bytes.
      if (codec->save_state() != std::vector<std::uint8_t>(rest.begin(), rest.end())) std::abort();
      return 0;
    }
    auto codec = gradsync::compress::make_codec(kSpecs[data[0] % std::size(kSpecs)]);
    std::vector<float> out(static_cast<std::size_t>(data[1]) |
                           (static_cast<std::size_t>(data[2]) << 8));
    if (data[0] & 64) {
      codec->decode_add(rest, out);
    } else {
      codec->decode(rest, out);
    }
  } catch (const gradsync::Error&) {
    // Refused with a clear error: what a malformed payload must get.
  }
  return 0;
}
