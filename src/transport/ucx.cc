// UCX transport (see ucx.h).
//
// Every message is one UCX tagged message of two pieces (an iov): a 48-byte header with the
// gradsync tag and length, then the payload, so both ends move it zero-copy and the receiver
// still checks what arrived against what it posted. The 64-bit UCX tag carries the kind of
// message, the sender and a per-pair sequence number; a receive posts the exact tag of the
// k-th message from its peer, which gives the FIFO matching transport.h promises whatever
// order UCX delivers in.
//
// Threads: one thread drives the transport at a time (transport.h), but abort() may come from
// another. `mu_` serialises every call into the UCX worker (created SERIALIZED); a waiter
// spins on ucp_worker_progress, then sleeps without the lock on the worker's event fd and on
// an eventfd of its own, which the progress thread writes when its progress completed the
// waiter's op (or lost its peer) and abort() when it ends the transport: the progress thread
// sleeps on the worker's fd too, and its next arm drains the fd, so the event that woke it may
// never reach the waiter.
//
// Here: messages, waits, failures and the shared arena's checks between sleeps; the class is
// in ucx_core.h, its setup in ucx_setup.cc, the arena in ucx_arena.h.
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "transport/shm_segment.h"
#include "transport/ucx_core.h"

namespace gradsync::transport::ucx {

using namespace std::chrono_literals;

void UcxTransport::wake_waiter_locked(bool always) {
  if (!sleeping_on_) return;
  // Only for news the waiter needs: progress of other ops would wake it just to sleep again,
  // a context switch each on cores its peers' ranks share.
  if (!always && !sleeping_on_->done && !lost_[static_cast<std::size_t>(sleeping_on_->peer)]) {
    return;
  }
  bump_eventfd(wake_fd_);  // (if it failed, the waiter's nap ends anyway)
}

void UcxTransport::check_peer(int peer, const char* what) const {
  if (peer < 0 || peer >= world_size_ || peer == rank_ ||
      !member_[static_cast<std::size_t>(peer)]) {
    throw Error(ErrorKind::kInvalidArgument,
                "peer " + std::to_string(peer) + " is not another rank of this ucx transport",
                rank_, peer, what);
  }
}

OpPtr UcxTransport::post(int peer, bool send, const Tag& tag, void* data, std::size_t bytes,
                         Kind kind, std::uint64_t seq) {
  auto op = std::make_shared<Op>();
  op->peer = peer;
  op->send = send;
  op->tag = tag;
  op->bytes = bytes;
  op->header.tag = tag;
  op->header.bytes = bytes;
  op->iov[0] = {&op->header, sizeof(WireHeader)};
  op->iov[1] = {data, bytes};
  op->data = kind == Kind::kData;
  std::lock_guard lock(mu_);
  // A receive is still posted after another rank's abort (until this rank quiesces): UCX may
  // hold its message already, sent before the abort by a rank that left the collective this
  // rank is still in; wait() takes it or fails with the abort.
  if (abort_ && (send || quiesced_)) {
    op->done = true;
    op->status = UCS_ERR_CANCELED;
    return op;
  }
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  param.datatype = ucp_dt_make_iov();
  param.user_data = op.get();
  const std::size_t pieces = bytes > 0 ? 2 : 1;
  ucs_status_ptr_t request;
  if (send) {
    param.cb.send = &Callbacks::sent;
    request = lib_.ucp_tag_send_nbx(endpoints_[static_cast<std::size_t>(peer)], op->iov, pieces,
                                    ucx_tag(kind, rank_, seq), &param);
  } else {
    param.cb.recv = &Callbacks::received;
    request = lib_.ucp_tag_recv_nbx(worker_, op->iov, pieces, ucx_tag(kind, peer, seq), kFullMask,
                                    &param);
  }
  if (!UCS_PTR_IS_PTR(request)) {
    op->done = true;
    op->status = UCS_PTR_STATUS(request);
    op->received = sizeof(WireHeader) + bytes;  // only sends complete at once
  } else if (!op->done) {  // else the callback ran (and freed the request) inside the call
    op->request = request;
    inflight_.emplace(op.get(), op);
    if (bytes >= kUnparkBytes && parked_.load(std::memory_order_seq_cst)) {
      bump_eventfd(unpark_fd_);  // (if it failed, the thread looks again within kParkLook)
    }
  }
  return op;
}

namespace {
// A Request over one Op; waits go through the transport, which owns the worker.
class UcxRequest final : public Request {
 public:
  UcxRequest(UcxTransport& transport, OpPtr op) : transport_(transport), op_(std::move(op)) {}
  ~UcxRequest() override { transport_.abandon(*op_); }
  bool test() override { return transport_.test(*op_); }
  void wait(Clock::time_point deadline) override { transport_.wait(*op_, deadline); }

 private:
  UcxTransport& transport_;
  OpPtr op_;
};
}  // namespace

RequestPtr UcxTransport::isend(int peer, const Tag& tag, const void* data, std::size_t bytes) {
  check_peer(peer, "send");
  std::uint64_t seq;
  {
    std::lock_guard lock(mu_);
    seq = send_seq_[static_cast<std::size_t>(peer)]++;
  }
  // UCX only reads a send's buffer; its iov type is not const.
  auto op = post(peer, true, tag, const_cast<void*>(data), bytes, Kind::kData, seq);
  return std::make_unique<UcxRequest>(*this, std::move(op));
}

RequestPtr UcxTransport::irecv(int peer, const Tag& tag, void* data, std::size_t bytes) {
  check_peer(peer, "recv");
  std::uint64_t seq;
  {
    std::lock_guard lock(mu_);
    seq = recv_seq_[static_cast<std::size_t>(peer)]++;
  }
  auto op = post(peer, false, tag, data, bytes, Kind::kData, seq);
  return std::make_unique<UcxRequest>(*this, std::move(op));
}

bool UcxTransport::finish_locked(Op& op) {
  if (!op.done) return false;
  if (op.finished) return true;  // tested again after it completed
  inflight_.erase(&op);
  if (op.status != UCS_OK) throw_failure_locked(op);
  auto& counters = traffic_[static_cast<std::size_t>(op.peer)];
  if (op.send) {
    op.finished = true;
    if (op.data) {
      counters.bytes_sent += op.bytes;
      ++counters.messages_sent;
    }
    return true;
  }
  const bool whole = op.received == sizeof(WireHeader) + op.bytes;
  const bool header_arrived = op.received >= sizeof(WireHeader) && op.header.magic == kHeaderMagic;
  if (!whole || !header_arrived || op.header.tag != op.tag || op.header.bytes != op.bytes) {
    std::string sent =
        header_arrived
            ? describe(op.header.tag) + " of " + std::to_string(op.header.bytes) + " bytes"
            : "a message of " + std::to_string(op.received - sizeof(WireHeader)) + " bytes";
    fail_locked(Error(ErrorKind::kMismatch,
                      "rank " + std::to_string(op.peer) + " sent " + sent + " where " +
                          describe(op.tag) + " of " + std::to_string(op.bytes) +
                          " bytes was expected (ranks issued different calls)",
                      rank_, op.peer, "recv", op.bytes));
  }
  op.finished = true;
  if (op.data) {
    counters.bytes_received += op.bytes;
    ++counters.messages_received;
  }
  return true;
}

void UcxTransport::throw_failure_locked(Op& op) {
  const char* what = op.send ? "send" : "recv";
  const std::string call = std::string(what) + " of " + describe(op.tag) +
                           (op.send ? " to" : " from") + " rank " + std::to_string(op.peer);
  if (abort_) {
    fail_locked(
        Error(ErrorKind::kAborted, call + " failed: " + *abort_, rank_, op.peer, what, op.bytes));
  }
  if (op.status == UCS_ERR_MESSAGE_TRUNCATED) {
    // UCX reports a cut-off message's whole length on some paths and only what it delivered
    // on others: the sender's size is named only when the length says more than was posted.
    const std::size_t posted = sizeof(WireHeader) + op.bytes;
    const std::string sent = op.received > posted
                                 ? std::to_string(op.received - sizeof(WireHeader)) + " bytes"
                                 : "more than the " + std::to_string(op.bytes) + " bytes";
    fail_locked(Error(ErrorKind::kMismatch,
                      "rank " + std::to_string(op.peer) + " sent " + sent + " where " +
                          describe(op.tag) + " of " + std::to_string(op.bytes) +
                          " bytes was expected (ranks issued different calls)",
                      rank_, op.peer, what, op.bytes));
  }
  const auto& lost = lost_[static_cast<std::size_t>(op.peer)];
  fail_locked(Error(ErrorKind::kPeerLost,
                    call + " failed: " + (lost ? *lost : lib_.ucs_status_string(op.status)), rank_,
                    op.peer, what, op.bytes));
}

void UcxTransport::fail_locked(const Error& error) {
  if (abort_) {
    quiesce_locked();
  } else if (error.kind() != ErrorKind::kMismatch) {
    abort_locked(error.what());
  }
  // A mismatch is left for the caller to abort with, as shm and tcp leave it: a context first
  // names the call ("mismatched call in allreduce #1"), and that is what every peer must quote.
  throw error;
}

void UcxTransport::quiesce_locked() {
  if (quiesced_) return;
  quiesced_ = true;
  std::vector<void*> closing;
  for (auto& ep : endpoints_) {
    if (!ep) continue;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* request = lib_.ucp_ep_close_nbx(ep, &param);
    if (UCS_PTR_IS_PTR(request)) closing.push_back(request);
    ep = nullptr;
  }
  cancel_receives_locked();
  frozen_ = !settle_locked(closing, Clock::now() + 200ms);
  for (void* request : closing) lib_.ucp_request_free(request);
}

void UcxTransport::discard_unexpected_locked(Clock::time_point deadline) {
  std::vector<char> scratch;
  while (Clock::now() < deadline) {
    ucp_tag_recv_info_t info{};
    ucp_tag_message_h message = lib_.ucp_tag_probe_nb(worker_, 0, 0, 1, &info);
    if (!message) return;
    scratch.resize(std::max<std::size_t>(info.length, 1));
    ucp_request_param_t param{};
    void* request =
        lib_.ucp_tag_msg_recv_nbx(worker_, scratch.data(), info.length, message, &param);
    if (!UCS_PTR_IS_PTR(request)) continue;
    while (lib_.ucp_request_check_status(request) == UCS_INPROGRESS && Clock::now() < deadline) {
      progress_locked();
    }
    if (lib_.ucp_request_check_status(request) == UCS_INPROGRESS) return;  // a large one: left
    lib_.ucp_request_free(request);
  }
}

void UcxTransport::cancel_receives_locked() {
  for (auto& [op, owner] : inflight_) {
    if (!op->send && op->request) lib_.ucp_request_cancel(worker_, op->request);
  }
}

bool UcxTransport::settle_locked(const std::vector<void*>& requests, Clock::time_point deadline) {
  while (Clock::now() < deadline) {
    progress_locked();
    const bool pending = std::any_of(requests.begin(), requests.end(), [this](void* r) {
      return lib_.ucp_request_check_status(r) == UCS_INPROGRESS;
    });
    // A request with a lost peer never ends, and UCX never touches its buffer again: a
    // receive waits for data that cannot come, a send for a peer that cannot fetch it.
    const bool held = std::any_of(inflight_.begin(), inflight_.end(), [this](const auto& entry) {
      const Op& op = *entry.first;
      return op.request && (op.peer < 0 || !lost_[static_cast<std::size_t>(op.peer)]);
    });
    if (!pending && !held) return true;
  }
  return false;
}

bool UcxTransport::test(Op& op) {
  std::lock_guard lock(mu_);
  drives_.fetch_add(1, std::memory_order_relaxed);
  if (!op.done) progress_locked();
  if (op.done) return finish_locked(op);
  if (abort_) throw_failure_locked(op);
  return false;
}

void UcxTransport::abandon(Op& op) {
  std::lock_guard lock(mu_);
  if (!op.done && !op.send && op.request) lib_.ucp_request_cancel(worker_, op.request);
}

void UcxTransport::wait(Op& op, Clock::time_point deadline) {
  std::unique_lock lock(mu_);
  drives_.fetch_add(1, std::memory_order_relaxed);
  waiters_.fetch_add(1, std::memory_order_relaxed);
  struct Leave {
    std::atomic<int>& waiters;
    ~Leave() { waiters.fetch_sub(1, std::memory_order_relaxed); }
  } leave{waiters_};
  auto spin_until = Clock::now() + spin_.duration;
  Clock::duration backoff = 20us;
  for (;;) {
    if (op.done) {
      finish_locked(op);
      return;
    }
    if (abort_) {
      // A last look: what arrived before the abort may need progress to complete.
      while (progress_locked() != 0) {
      }
      if (!op.done) throw_failure_locked(op);
      continue;
    }
    // A receive from a lost peer never completes (UCX fails only the lost endpoint's sends,
    // and only where it watches the peer).
    if (lost_[static_cast<std::size_t>(op.peer)]) {
      op.status = UCS_ERR_CONNECTION_RESET;
      throw_failure_locked(op);
    }
    if (progress_locked() != 0) {
      spin_until = Clock::now() + spin_.duration;
      continue;
    }
    const auto now = Clock::now();
    if (now >= deadline) break;
    if (now < spin_until) {
      if (spin_.yield) std::this_thread::yield();
      continue;
    }
    check_watched_locked();
    if (lost_[static_cast<std::size_t>(op.peer)]) continue;
    // Sleep until UCX has something (this thread armed the worker: its own progress may have
    // consumed the arming the progress thread slept on), the progress thread has progressed
    // the worker, abort() ends the transport, a watched peer exits, or the deadline (at most
    // 100 ms, so that the checks above run). UCX refuses to arm while it holds events that
    // progress did not consume: then a nap of 20 us, doubling to 1 ms while it refuses.
    const bool armed = event_fd_ >= 0 && lib_.ucp_worker_arm(worker_) != UCS_ERR_BUSY;
    const auto nap = std::min<Clock::duration>(
        deadline - now, armed || event_fd_ < 0 ? Clock::duration(100ms) : backoff);
    if (!armed) backoff = std::min<Clock::duration>(2 * backoff, 1ms);
    std::vector<pollfd> fds{{wake_fd_, POLLIN, 0}};
    if (armed) fds.push_back({event_fd_, POLLIN, 0});
    for (const auto& w : watched_) {
      if (w.pidfd >= 0) fds.push_back({w.pidfd, POLLIN, 0});
    }
    const auto nap_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(nap).count();
    const timespec timeout{static_cast<time_t>(nap_ns / 1'000'000'000),
                           static_cast<long>(nap_ns % 1'000'000'000)};
    sleeping_on_ = &op;
    lock.unlock();
    ::ppoll(fds.data(), fds.size(), &timeout, nullptr);
    lock.lock();
    sleeping_on_ = nullptr;
    std::uint64_t count = 0;
    if ((fds[0].revents & POLLIN) != 0 && ::read(wake_fd_, &count, sizeof count) < 0) {
      // Cannot happen: the eventfd is readable.
    }
  }
  const char* what = op.send ? "send" : "recv";
  throw Error(ErrorKind::kTimeout,
              std::string(what) + " of " + describe(op.tag) + (op.send ? " to" : " from") +
                  " rank " + std::to_string(op.peer) +
                  " did not complete: " + std::to_string(op.bytes) + " of " +
                  std::to_string(op.bytes) + " bytes still " + (op.send ? "unsent" : "missing"),
              rank_, op.peer, what, op.bytes);
}

void UcxTransport::post_abort_receive_locked() {
  abort_receive_ = std::make_shared<Op>();
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.user_data = this;
  param.cb.recv = [](void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                     void* user_data) {
    auto* self = static_cast<UcxTransport*>(user_data);
    if (status == UCS_OK || status == UCS_ERR_MESSAGE_TRUNCATED) {
      self->on_abort_message_locked(info->sender_tag, std::min(info->length, kAbortTextMax));
    }
    self->abort_receive_->request = nullptr;
    self->lib_.ucp_request_free(request);
  };
  void* request = lib_.ucp_tag_recv_nbx(worker_, abort_text_.data(), abort_text_.size(),
                                        ucx_tag(Kind::kAbort, 0, 0), kKindMask, &param);
  if (UCS_PTR_IS_PTR(request)) {
    abort_receive_->request = request;
    inflight_.emplace(abort_receive_.get(), abort_receive_);
  }
}

void UcxTransport::on_abort_message_locked(std::uint64_t sender_tag, std::size_t length) {
  inflight_.erase(abort_receive_.get());
  if (abort_) return;
  abort_ = "rank " + std::to_string(sender_of(sender_tag)) +
           " aborted: " + std::string(abort_text_.data(), length);
  if (arena_) arena_->wake_own();
}

void UcxTransport::on_peer_failure_locked(int peer, ucs_status_t status) {
  auto& lost = lost_[static_cast<std::size_t>(peer)];
  if (!lost) {
    lost = "rank " + std::to_string(peer) + " was lost (" + lib_.ucs_status_string(status) + ")";
  }
}

void UcxTransport::check_watched_locked() {
  for (const auto& w : watched_) {
    auto& lost = lost_[static_cast<std::size_t>(w.peer)];
    if (lost) continue;
    bool alive;
    if (w.pidfd >= 0) {
      pollfd p{w.pidfd, POLLIN, 0};
      alive = ::poll(&p, 1, 0) == 0;
    } else {
      alive = shm::process_alive_by_proc(w.pid);
    }
    if (!alive) {
      lost = "rank " + std::to_string(w.peer) + " was lost (its process " + std::to_string(w.pid) +
             " exited)";
    }
  }
}

bool UcxTransport::drain_locked(const std::vector<OpPtr>& ops, Clock::time_point deadline) {
  for (;;) {
    if (std::all_of(ops.begin(), ops.end(), [](const OpPtr& op) { return op->done; })) return true;
    if (Clock::now() >= deadline) return false;
    if (progress_locked() == 0) std::this_thread::yield();
  }
}

bool UcxTransport::arena_wait_over(int member, std::uint64_t value, const Tag& call,
                                   Clock::time_point deadline, bool check_process) {
  std::lock_guard lock(mu_);
  auto reached = [&] { return arena_->progress(member) >= value; };
  if (reached()) return true;
  // abort_ changes only under mu_, held here: it was recorded before reached() looked, so a
  // value published before the abort has been seen.
  if (abort_) {
    throw Error(ErrorKind::kAborted, describe(call) + " failed: " + *abort_, rank_, member,
                "ucx arena wait");
  }
  // While every rank runs the same arena collective no messages flow: a message means its
  // sender runs a message-based collective instead, unless it left this one first (it then
  // published every value any rank waits for in it before it sent).
  while (progress_locked() != 0) {
  }
  int sender = -1;
  if (auto stray = stray_message_locked(sender)) {
    if (reached()) return true;
    fail_locked(Error(ErrorKind::kMismatch,
                      *stray +
                          " over the message path while this rank waits in shared memory for " +
                          describe(call),
                      rank_, sender, "ucx arena wait"));
  }
  if (check_process) check_watched_locked();
  const auto& lost = lost_[static_cast<std::size_t>(member)];
  if (arena_->closed(member) || lost) {
    if (reached()) return true;  // it published what we wait for before it left
    fail_locked(Error(ErrorKind::kPeerLost,
                      (lost ? *lost : "rank " + std::to_string(member) + " closed its transport") +
                          " with its shared-memory progress at " +
                          std::to_string(arena_->progress(member)) + ", short of the " +
                          std::to_string(value) + " this rank waits for in " + describe(call),
                      rank_, member, "ucx arena wait"));
  }
  if (Clock::now() >= deadline) {
    throw Error(ErrorKind::kTimeout,
                describe(call) + ": rank " + std::to_string(member) +
                    "'s shared-memory progress is still " +
                    std::to_string(arena_->progress(member)) + ", this rank waits for " +
                    std::to_string(value),
                rank_, member, "ucx arena wait");
  }
  return false;
}

std::optional<std::string> UcxTransport::stray_message_locked(int& sender) {
  ucp_tag_recv_info_t info{};
  ucp_tag_message_h message =
      lib_.ucp_tag_probe_nb(worker_, ucx_tag(Kind::kData, 0, 0), kKindMask, 1, &info);
  if (!message) return std::nullopt;
  sender = sender_of(info.sender_tag);
  std::string what = "rank " + std::to_string(sender) + " sent a message";
  // Its header names the call: received whole (the transport is about to end anyway), for at
  // most 200 ms, into a buffer that lives as long as the transport, in case UCX still holds it.
  auto& bytes = stray_message_;
  bytes.assign(std::max<std::size_t>(info.length, sizeof(WireHeader)), 0);
  ucp_request_param_t param{};
  void* request = lib_.ucp_tag_msg_recv_nbx(worker_, bytes.data(), info.length, message, &param);
  const auto until = Clock::now() + 200ms;
  bool whole = !UCS_PTR_IS_PTR(request) && UCS_PTR_STATUS(request) == UCS_OK;
  if (UCS_PTR_IS_PTR(request)) {
    while (lib_.ucp_request_check_status(request) == UCS_INPROGRESS && Clock::now() < until) {
      progress_locked();
    }
    whole = lib_.ucp_request_check_status(request) == UCS_OK;
    if (whole || lib_.ucp_request_check_status(request) != UCS_INPROGRESS) {
      lib_.ucp_request_free(request);
    }
  }
  WireHeader header;
  if (whole && info.length >= sizeof header) {
    std::memcpy(&header, bytes.data(), sizeof header);
    if (header.magic == kHeaderMagic) {
      what = "rank " + std::to_string(sender) + " sent " + describe(header.tag) + " (" +
             std::to_string(header.bytes) + " bytes)";
    }
  }
  return what;
}

void UcxTransport::abort(const std::string& reason) {
  std::lock_guard lock(mu_);
  abort_locked(reason);
}

void UcxTransport::abort_locked(const std::string& reason) {
  if (abort_) return;
  // Tell every peer still there, then fail this rank's own operations: abort_ set before the
  // notices go out would cancel them in post().
  std::vector<OpPtr> notices;
  const std::size_t length = std::min(reason.size(), kAbortTextMax);
  for (int peer = 0; peer < world_size_; ++peer) {
    const auto p = static_cast<std::size_t>(peer);
    if (!endpoints_[p] || lost_[p]) continue;
    auto op = std::make_shared<Op>();
    op->peer = peer;
    op->send = true;
    op->data = false;
    op->text = reason.substr(0, length);
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.user_data = op.get();
    param.cb.send = &Callbacks::sent;
    void* request = lib_.ucp_tag_send_nbx(endpoints_[p], op->text.data(), op->text.size(),
                                          ucx_tag(Kind::kAbort, rank_, 0), &param);
    if (UCS_PTR_IS_PTR(request)) {
      op->request = request;
      inflight_.emplace(op.get(), op);
      notices.push_back(op);
    }
  }
  // Bounded: a peer that cannot take the notice is lost anyway.
  drain_locked(notices, Clock::now() + 500ms);
  abort_ = reason;
  quiesce_locked();
  wake_waiter_locked(true);
  if (arena_) arena_->wake_own();
}

PeerTraffic UcxTransport::traffic(int peer) const {
  std::lock_guard lock(mu_);
  if (peer < 0 || peer >= world_size_) return {};
  return traffic_[static_cast<std::size_t>(peer)];
}

}  // namespace gradsync::transport::ucx
