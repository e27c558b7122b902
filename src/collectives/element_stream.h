// Adapts a transport's byte-piece consumer to whole elements: a transport may split a
// message anywhere, but a reduction must see whole elements. Carries at most one
// partial element between pieces.
#pragma once

#include <cstddef>
#include <cstring>
#include <functional>

#include "gradsync/types.h"

namespace gradsync::collectives {

// Calls fn(element_offset, data, element_count) for consecutive runs of whole elements.
class ElementStream {
 public:
  using Fn = std::function<void(std::size_t elem_offset, const void* data, std::size_t elems)>;
  ElementStream(std::size_t elem_size, Fn fn) : elem_size_(elem_size), fn_(std::move(fn)) {}

  void operator()(const void* data, std::size_t offset, std::size_t len) {
    const auto* p = static_cast<const unsigned char*>(data);
    std::size_t elem = offset / elem_size_;
    if (carried_ != 0) {  // finish the element split across the previous piece
      std::size_t need = elem_size_ - carried_;
      std::size_t take = need < len ? need : len;
      std::memcpy(partial_ + carried_, p, take);
      carried_ += take;
      p += take;
      len -= take;
      if (carried_ < elem_size_) return;
      fn_(offset / elem_size_, partial_, 1);
      carried_ = 0;
      elem = (offset + take) / elem_size_;
    }
    std::size_t whole = len / elem_size_;
    if (whole) fn_(elem, p, whole);
    std::size_t rest = len - whole * elem_size_;
    if (rest) {
      std::memcpy(partial_, p + whole * elem_size_, rest);
      carried_ = rest;
    }
  }

 private:
  std::size_t elem_size_;
  Fn fn_;
  unsigned char partial_[16] = {};
  std::size_t carried_ = 0;
};

}  // namespace gradsync::collectives
