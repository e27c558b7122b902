// Shared pieces of the transport interface: the default consuming receive, tag printing and the
// group check of every factory.
#include "transport/transport.h"

#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <thread>
#include <vector>

namespace gradsync::transport {

namespace {
// Receives into an owned buffer, then hands the whole message to the consumer at once.
class BufferedConsumeRequest final : public Request {
 public:
  BufferedConsumeRequest(Transport& t, int peer, const Tag& tag, std::size_t bytes,
                         Consumer consume)
      : buffer_(bytes), consume_(std::move(consume)) {
    inner_ = t.irecv(peer, tag, buffer_.data(), bytes);
  }
  bool test() override {
    if (done_) return true;
    if (!inner_->test()) return false;
    finish();
    return true;
  }
  void wait(Clock::time_point deadline) override {
    if (done_) return;
    inner_->wait(deadline);
    finish();
  }

 private:
  void finish() {
    done_ = true;
    if (!buffer_.empty()) consume_(buffer_.data(), 0, buffer_.size());
  }
  std::vector<unsigned char> buffer_;
  Consumer consume_;
  RequestPtr inner_;
  bool done_ = false;
};
}  // namespace

RequestPtr Transport::irecv_consume(int peer, const Tag& tag, std::size_t bytes, Consumer consume) {
  return std::make_unique<BufferedConsumeRequest>(*this, peer, tag, bytes, std::move(consume));
}

std::string default_format_tag(const Tag& tag) {
  char buf[80];
  std::snprintf(
      buf, sizeof buf, "tag %016llx:%016llx:%016llx:%016llx",
      static_cast<unsigned long long>(tag.words[0]), static_cast<unsigned long long>(tag.words[1]),
      static_cast<unsigned long long>(tag.words[2]), static_cast<unsigned long long>(tag.words[3]));
  return buf;
}

void check_group(int rank, int world_size, const std::vector<int>& group, const char* what) {
  if (world_size <= 0 || rank < 0 || rank >= world_size ||
      !std::is_sorted(group.begin(), group.end()) ||
      std::adjacent_find(group.begin(), group.end()) != group.end() ||
      !std::binary_search(group.begin(), group.end(), rank) ||
      (!group.empty() && (group.front() < 0 || group.back() >= world_size))) {
    throw Error(ErrorKind::kInvalidArgument,
                "group must be sorted distinct ranks in [0, world_size) that include this rank",
                rank, Error::kNoPeer, what);
  }
}

unsigned usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) == 0) return static_cast<unsigned>(CPU_COUNT(&set));
  return std::thread::hardware_concurrency();
}

}  // namespace gradsync::transport
