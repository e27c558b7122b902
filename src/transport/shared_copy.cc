// copy_to_shared; see shared_arena.h.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "transport/shared_arena.h"

namespace gradsync::transport {

void copy_to_shared(void* dst, const void* src, std::size_t bytes) {
  constexpr std::uintptr_t kPage = 4096, kLine = 64;
  const auto to_address = reinterpret_cast<std::uintptr_t>(dst);
  const std::uintptr_t distance = (to_address - reinterpret_cast<std::uintptr_t>(src)) % kPage;
  if (distance == 0 || distance >= kLine || bytes < kPage) {
    std::memcpy(dst, src, bytes);
    return;
  }
  // Through a private buffer placed a whole number of lines before `dst` modulo a page: the
  // copy into shared memory is then a fast one, and the copy into the buffer, between this
  // core's own cached lines, pays little for its distance (docs/performance-notes.md).
  constexpr std::size_t kChunk = 32 * 1024;  // rep movsb still, and within L1
  alignas(kPage) unsigned char bounce[kChunk + kLine];
  unsigned char* staged = bounce + (to_address % kLine);
  auto* to = static_cast<unsigned char*>(dst);
  const auto* from = static_cast<const unsigned char*>(src);
  for (std::size_t done = 0; done < bytes; done += kChunk) {
    const std::size_t length = std::min(kChunk, bytes - done);
    std::memcpy(staged, from + done, length);
    std::memcpy(to + done, staged, length);
  }
}

}  // namespace gradsync::transport
