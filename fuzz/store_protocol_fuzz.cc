// libFuzzer target for the TCP store protocol: request/response parsers and the stream
// splitter on arbitrary bytes. Accepted messages must re-encode to the same bytes, and
// splitting must not depend on how the stream was chunked.
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "rendezvous/store_protocol.h"

namespace sp = gradsync::store_protocol;

namespace {

void check(bool ok) {
  if (!ok) std::abort();
}

// encode(parse(body)) == length prefix + body: parsing is strict enough that every
// accepted message has exactly one encoding.
void round_trips(std::span<const std::uint8_t> body) {
  auto same = [&](const sp::Bytes& encoded) {
    check(encoded.size() == body.size() + sp::kLengthPrefixBytes);
    check(std::equal(body.begin(), body.end(), encoded.begin() + sp::kLengthPrefixBytes));
  };
  if (auto req = sp::parse_request(body)) {
    same(sp::encode_request(*req));
    check(req->key.size() <= sp::kMaxKeyBytes && req->value.size() <= sp::kMaxValueBytes);
    check(req->keys.size() <= sp::kMaxWaitKeys);
  }
  for (auto type : {sp::RequestType::kProof, sp::RequestType::kSet, sp::RequestType::kGet,
                    sp::RequestType::kWait, sp::RequestType::kAdd, sp::RequestType::kCheck,
                    sp::RequestType::kHello}) {
    if (auto resp = sp::parse_response(type, body)) same(sp::encode_response(type, *resp));
  }
}

using Split = std::vector<std::vector<std::uint8_t>>;

// Splits `stream` into message bodies, fed in chunks of the given sizes (cycled).
// Returns the bodies, and whether the splitter stopped on an over-long length.
Split split(std::span<const std::uint8_t> stream, const std::vector<std::size_t>& chunks,
            std::size_t max_body, bool& too_long) {
  sp::MessageReader reader(max_body);
  Split out;
  too_long = false;
  std::size_t pos = 0, c = 0;
  while (pos < stream.size() && !too_long) {
    std::size_t n = std::min(stream.size() - pos, chunks[c++ % chunks.size()]);
    reader.append(stream.data() + pos, n);
    pos += n;
    for (;;) {
      std::span<const std::uint8_t> body;
      auto r = reader.next(body);
      if (r == sp::MessageReader::Result::kNeedMore) break;
      if (r == sp::MessageReader::Result::kTooLong) {
        too_long = true;
        break;
      }
      check(body.size() <= max_body);
      out.emplace_back(body.begin(), body.end());
    }
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::span<const std::uint8_t> in(data, size);
  round_trips(in);

  if (size == 0) return 0;
  // First byte picks a chunking and a body limit; the rest is the stream.
  std::size_t knob = data[0];
  auto stream = in.subspan(1);
  std::size_t max_body = knob & 1 ? 64 : sp::kMaxMessageBytes;
  bool too_long_whole = false, too_long_chunked = false;
  Split whole = split(stream, {stream.size() + 1}, max_body, too_long_whole);
  Split chunked =
      split(stream, {1 + (knob >> 1) % 7, 1, 3 + (knob >> 4)}, max_body, too_long_chunked);
  check(whole == chunked);
  check(too_long_whole == too_long_chunked);
  for (const auto& body : whole) round_trips(body);
  return 0;
}
