// Scratch memory of the collective algorithms that outlives the call.
#pragma once

#include <cstddef>

namespace gradsync::collectives {

// What a buffer is for: one call may hold several at once (the hierarchical reduce-scatter
// holds its regrouped input and its own blocks while the ring inside it holds partial sums),
// never two of the same use.
enum class ScratchUse {
  kPartialSums,   // ring reduce-scatter; the rooted reduce's accumulator
  kIncoming,      // a whole message received (or copied out of shared memory) before it is reduced
  kRegrouped,     // the hierarchical collectives' input or output in grouped order
  kOwnBlocks,     // the hierarchical reduce-scatter's blocks between its two levels
  kWireCopies,    // the encoded ring: every segment's wire copy
  kWireIncoming,  // the encoded ring: one received segment
  kWireSent,      // the encoded ring: what a segment decodes to, for error feedback
  kCount
};

// At least `bytes` of scratch for `use`, 64-byte aligned, contents unspecified: callers write
// every byte they read. One buffer per use and thread, only ever grown and kept until the
// thread ends. A fresh large allocation comes from mmap, and its first touch faults every page
// in (about 13 us a page on the VM of docs/performance-notes.md): for a 16 MiB call that is
// more time than moving its bytes over a 1 Gbit/s link. Per thread, so the second thread of a
// hierarchical all-reduce and a caller running its own blocking call never share a buffer
// with the context's worker.
void* scratch(ScratchUse use, std::size_t bytes);

template <class T>
T* scratch_of(ScratchUse use, std::size_t count) {
  return static_cast<T*>(scratch(use, count * sizeof(T)));
}

}  // namespace gradsync::collectives
