// libFuzzer target for the TCP transport's frame format: parsers must reject or accept any
// bytes without crashing, and whatever they accept must re-encode to the same bytes.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>

#include "transport/frame.h"

namespace frame = gradsync::transport::frame;

namespace {

void check(bool ok) {
  if (!ok) std::abort();  // libFuzzer reports the input that got here
}

// Every accepted header is canonical: flags zero, known type, length within the limit.
void header_round_trip(const std::uint8_t* data, std::uint64_t max_data) {
  frame::Header h;
  if (frame::parse_header(data, max_data, h) != frame::ParseStatus::kOk) return;
  std::uint8_t out[frame::kHeaderBytes];
  frame::encode_header(h, out);
  check(std::memcmp(out, data, frame::kHeaderBytes) == 0);
  if (h.type == frame::Type::kData) check(h.length <= max_data);
  if (h.type == frame::Type::kHello) check(h.length <= frame::kMaxHelloBytes);
  if (h.type == frame::Type::kAbort) check(h.length <= frame::kMaxAbortBytes);
  if (h.type == frame::Type::kProbe || h.type == frame::Type::kProbeAnswer) {
    check(h.length <= frame::kMaxProbeBytes);
  }
}

void payload_round_trips(std::span<const std::uint8_t> payload) {
  if (auto hello = frame::parse_hello(payload)) {
    auto again = frame::encode_hello(*hello);
    check(again.size() == payload.size() &&
          std::equal(again.begin(), again.end(), payload.begin()));
    check(frame::parse_hello(again) == hello);
  }
  if (auto abort = frame::parse_abort(payload)) {
    auto again = frame::encode_abort(*abort);
    check(again.size() == payload.size() &&
          std::equal(again.begin(), again.end(), payload.begin()));
  }
  if (auto probe = frame::parse_probe(payload)) {
    auto again = frame::encode_probe(*probe);
    check(again.size() == payload.size() &&
          std::equal(again.begin(), again.end(), payload.begin()));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::span<const std::uint8_t> in(data, size);
  payload_round_trips(in);

  // The input as a stream of frames, walked the way the transport's reader does: a header,
  // then exactly the declared payload, then the next header.
  std::size_t pos = 0;
  while (size - pos >= frame::kHeaderBytes) {
    header_round_trip(data + pos, frame::kDefaultMaxDataBytes);
    header_round_trip(data + pos, 1000);  // a small configured limit too
    frame::Header h;
    if (frame::parse_header(data + pos, frame::kDefaultMaxDataBytes, h) != frame::ParseStatus::kOk)
      break;
    pos += frame::kHeaderBytes;
    if (h.length > size - pos) break;  // truncated: the reader would wait for more bytes
    payload_round_trips(in.subspan(pos, static_cast<std::size_t>(h.length)));
    pos += static_cast<std::size_t>(h.length);
  }
  return 0;
}
