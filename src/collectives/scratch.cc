#include "collectives/scratch.h"

#include <array>
#include <memory>
#include <new>

namespace gradsync::collectives {

namespace {
constexpr std::align_val_t kAlignment{64};  // a cache line: no buffer shares one with another

struct AlignedDelete {
  void operator()(void* p) const { ::operator delete(p, kAlignment); }
};

struct Buffer {
  std::unique_ptr<void, AlignedDelete> data;
  std::size_t bytes = 0;
};
}  // namespace

void* scratch(ScratchUse use, std::size_t bytes) {
  thread_local std::array<Buffer, static_cast<std::size_t>(ScratchUse::kCount)> buffers;
  Buffer& b = buffers[static_cast<std::size_t>(use)];
  if (b.bytes < bytes || !b.data) {
    b.data.reset();  // the old buffer goes first: never both at once
    b.bytes = 0;
    b.data.reset(::operator new(bytes ? bytes : 1, kAlignment));
    b.bytes = bytes;
  }
  return b.data.get();
}

}  // namespace gradsync::collectives
