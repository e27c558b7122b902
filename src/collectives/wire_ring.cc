// The float32 ring all-reduce with encoded messages (see algorithms.h). One message per
// segment and step: simpler than the pipelined ring, and the encodings run on whole segments.
#include <vector>

#include "collectives/algorithms.h"
#include "collectives/scratch.h"
#include "kernels/kernels.h"

namespace gradsync::collectives {

void ring_allreduce_wire(Comm& c, float* data, std::size_t count, WireFormat& wire, float* lost) {
  // One rank too goes through the format (its encode and decode, and what they drop), so a
  // codec means the same for every world size.
  const long long n = c.size(), p = c.ring_position();
  const int right = c.ring_rank(p + 1), left = c.ring_rank(p - 1);
  const Partition part{count, static_cast<std::size_t>(n)};
  auto seg = [&](long long s) { return static_cast<std::size_t>(((s % n) + n) % n); };
  std::vector<std::size_t> at(static_cast<std::size_t>(n) + 1, 0);  // segment offsets in wire
  for (std::size_t s = 0; s < static_cast<std::size_t>(n); ++s) {
    at[s + 1] = at[s] + wire.bytes(part.size(s));
  }
  // Wire copies of every segment (what this rank sent or received of it) and one segment's
  // scratch.
  auto* wire_buf = scratch_of<std::uint8_t>(ScratchUse::kWireCopies, at.back());
  auto* incoming = scratch_of<std::uint8_t>(ScratchUse::kWireIncoming, wire.bytes(part.size(0)));
  float* sent = lost ? scratch_of<float>(ScratchUse::kWireSent, part.size(0)) : nullptr;
  // Encodes segment s of data into its wire copy, and books what the encoding dropped.
  auto encode = [&](std::size_t s) {
    float* values = data + part.offset(s);
    wire.encode(values, part.size(s), wire_buf + at[s]);
    if (!lost) return;
    wire.decode(wire_buf + at[s], part.size(s), sent);
    float* l = lost + part.offset(s);
    for (std::size_t i = 0; i < part.size(s); ++i) l[i] += values[i] - sent[i];
  };

  // Reduce-scatter: step s sends segment p - s and adds segment p - s - 1 from the left, in
  // float32, into `data`.
  for (long long s = 0; s < n - 1; ++s) {
    const std::size_t out = seg(p - s), in = seg(p - s - 1);
    encode(out);
    auto request = c.isend(right, wire_buf + at[out], at[out + 1] - at[out]);
    c.recv(left, incoming, at[in + 1] - at[in]);
    wire.decode_add(incoming, part.size(in), data + part.offset(in));
    c.wait(request);
  }
  // This rank now holds the whole sum of segment p + 1: it encodes it once, and every rank,
  // this one included, takes the decoded value.
  const std::size_t owned = seg(p + 1);
  encode(owned);
  wire.decode(wire_buf + at[owned], part.size(owned), data + part.offset(owned));

  // All-gather: forward the finished segments in the wire format.
  for (long long t = 0; t < n - 1; ++t) {
    const std::size_t out = seg(static_cast<long long>(owned) - t),
                      in = seg(static_cast<long long>(owned) - t - 1);
    auto request = c.isend(right, wire_buf + at[out], at[out + 1] - at[out]);
    c.recv(left, wire_buf + at[in], at[in + 1] - at[in]);
    wire.decode(wire_buf + at[in], part.size(in), data + part.offset(in));
    c.wait(request);
  }
}

}  // namespace gradsync::collectives
