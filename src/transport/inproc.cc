// In-process transport over mutex-protected mailboxes, one per ordered pair of ranks.
#include "transport/inproc.h"

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>

namespace gradsync::transport {

namespace {
struct Message {
  Tag tag;
  std::vector<unsigned char> payload;
};

struct Mailbox {
  std::uint64_t next_send = 0;  // sequence number of the next message sent on this pair
  std::uint64_t next_post = 0;  // sequence number the next posted receive will match
  std::map<std::uint64_t, Message> messages;                // sent but not yet taken
  std::uint64_t bytes_sent = 0, messages_sent = 0;          // counted by the sender
  std::uint64_t bytes_received = 0, messages_received = 0;  // counted when a receive takes it
};
}  // namespace

class InprocGroup {
 public:
  explicit InprocGroup(int size) : size_(size), boxes_(static_cast<std::size_t>(size * size)) {}
  int size() const { return size_; }
  Mailbox& box(int src, int dst) { return boxes_[static_cast<std::size_t>(src * size_ + dst)]; }

  std::mutex mu;
  std::condition_variable cv;
  std::optional<std::string> abort_reason;  // guarded by mu; sticky once set

 private:
  int size_;
  std::vector<Mailbox> boxes_;
};

std::shared_ptr<InprocGroup> make_inproc_group(int size) {
  return std::make_shared<InprocGroup>(size);
}

namespace {

class DoneRequest final : public Request {
 public:
  bool test() override { return true; }
  void wait(Clock::time_point) override {}
};

class InprocTransport;

class InprocRecv final : public Request {
 public:
  InprocRecv(InprocTransport& t, int peer, const Tag& tag, void* data, std::size_t bytes,
             std::uint64_t seq)
      : t_(t), peer_(peer), tag_(tag), data_(data), bytes_(bytes), seq_(seq) {}
  bool test() override;
  void wait(Clock::time_point deadline) override;

 private:
  bool try_take_locked();  // caller holds group mu
  InprocTransport& t_;
  int peer_;
  Tag tag_;
  void* data_;
  std::size_t bytes_;
  std::uint64_t seq_;
  bool done_ = false;
};

class InprocTransport final : public Transport {
 public:
  InprocTransport(std::shared_ptr<InprocGroup> group, int rank, TransportOptions options)
      : group_(std::move(group)), rank_(rank), options_(std::move(options)) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  const char* name() const override { return "inproc"; }

  RequestPtr isend(int peer, const Tag& tag, const void* data, std::size_t bytes) override {
    check_peer(peer, "send", bytes);
    std::lock_guard lock(group_->mu);
    throw_if_aborted_locked(peer);
    Mailbox& box = group_->box(rank_, peer);
    Message m{tag, std::vector<unsigned char>(bytes)};
    if (bytes) std::memcpy(m.payload.data(), data, bytes);
    box.messages.emplace(box.next_send++, std::move(m));
    box.bytes_sent += bytes;
    box.messages_sent += 1;
    group_->cv.notify_all();
    return std::make_unique<DoneRequest>();
  }

  RequestPtr irecv(int peer, const Tag& tag, void* data, std::size_t bytes) override {
    check_peer(peer, "recv", bytes);
    std::lock_guard lock(group_->mu);
    // Not refused after an abort: a message sent before it is still taken (test, wait).
    std::uint64_t seq = group_->box(peer, rank_).next_post++;
    return std::make_unique<InprocRecv>(*this, peer, tag, data, bytes, seq);
  }

  void abort(const std::string& reason) override {
    std::lock_guard lock(group_->mu);
    if (!group_->abort_reason)
      group_->abort_reason = "rank " + std::to_string(rank_) + ": " + reason;
    group_->cv.notify_all();
  }

  PeerTraffic traffic(int peer) const override {
    std::lock_guard lock(group_->mu);
    const Mailbox& out = group_->box(rank_, peer);
    const Mailbox& in = group_->box(peer, rank_);
    return PeerTraffic{out.bytes_sent, in.bytes_received, out.messages_sent, in.messages_received};
  }

  void throw_if_aborted_locked(int peer) const {
    if (group_->abort_reason) {
      throw Error(ErrorKind::kAborted, *group_->abort_reason, rank_, peer, "inproc transport");
    }
  }
  std::string describe(const Tag& tag) const {
    return options_.format_tag ? options_.format_tag(tag) : default_format_tag(tag);
  }
  InprocGroup& group() { return *group_; }

 private:
  void check_peer(int peer, const char* what, std::size_t bytes) const {
    if (peer < 0 || peer >= size() || peer == rank_) {
      throw Error(ErrorKind::kInvalidArgument, std::string("bad peer for ") + what, rank_, peer,
                  "inproc transport", bytes);
    }
  }

  std::shared_ptr<InprocGroup> group_;
  int rank_;
  TransportOptions options_;
};

bool InprocRecv::try_take_locked() {
  Mailbox& box = t_.group().box(peer_, t_.rank());
  auto it = box.messages.find(seq_);
  if (it == box.messages.end()) return false;
  Message& m = it->second;
  if (!(m.tag == tag_) || m.payload.size() != bytes_) {
    std::string detail = "expected " + t_.describe(tag_) + " (" + std::to_string(bytes_) +
                         " bytes) but peer sent " + t_.describe(m.tag) + " (" +
                         std::to_string(m.payload.size()) + " bytes)";
    throw Error(ErrorKind::kMismatch, detail, t_.rank(), peer_, "inproc transport", bytes_);
  }
  if (bytes_) std::memcpy(data_, m.payload.data(), bytes_);
  box.bytes_received += bytes_;
  box.messages_received += 1;
  box.messages.erase(it);
  done_ = true;
  return true;
}

bool InprocRecv::test() {
  if (done_) return true;
  std::lock_guard lock(t_.group().mu);
  if (try_take_locked()) return true;
  t_.throw_if_aborted_locked(peer_);
  return false;
}

void InprocRecv::wait(Clock::time_point deadline) {
  if (done_) return;
  std::unique_lock lock(t_.group().mu);
  while (!try_take_locked()) {
    t_.throw_if_aborted_locked(peer_);
    if (t_.group().cv.wait_until(lock, deadline) == std::cv_status::timeout &&
        Clock::now() >= deadline) {
      if (try_take_locked()) return;
      throw Error(ErrorKind::kTimeout,
                  "no message from peer for " + t_.describe(tag_) + ": all " +
                      std::to_string(bytes_) + " bytes still missing",
                  t_.rank(), peer_, "recv", bytes_);
    }
  }
}

}  // namespace

std::unique_ptr<Transport> make_inproc_transport(std::shared_ptr<InprocGroup> group, int rank,
                                                 const TransportOptions& options) {
  return std::make_unique<InprocTransport>(std::move(group), rank, options);
}

}  // namespace gradsync::transport
