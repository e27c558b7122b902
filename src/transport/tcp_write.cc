// The write side of the tcp transport: queuing sends and control frames, writing them with
// sendmsg, the backlog a full socket leaves, and settling queued sends after an abort.
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>

#include "transport/tcp_core.h"

namespace gradsync::transport::tcp {

namespace {

// iovecs per sendmsg: enough to batch dozens of small messages per syscall; far below
// the kernel's IOV_MAX (1024).
constexpr int kMaxIov = 64;

}  // namespace

std::shared_ptr<SendOp> Core::post_send(int peer, const Tag& tag, const void* data,
                                        std::size_t bytes) {
  auto op = std::make_shared<SendOp>();
  op->tag = tag;
  op->data = static_cast<const std::uint8_t*>(data);
  op->bytes = bytes;
  frame::encode_header(frame::Header{frame::Type::kData, tag, bytes}, op->header);
  std::unique_lock lk(mu_);
  Peer& p = peer_checked(peer, "send", bytes);
  if (const Failure* f = failure_for(p)) throw error_of(*f, peer, "send", bytes);
  last_tag_ = tag;
  p.sendq.push_back(op);
  // Write from this thread when the loop is not already busy with this socket: saves
  // a thread hand-off for small messages, and large ones just fill the socket buffer.
  if (p.write_side != WriteSide::kLoop) flush_locked(p, lk);
  return op;
}

void Core::abandon(SendOp& op, int peer) {
  std::unique_lock lk(mu_);
  wait_out_syscall_locked(lk, peer, &Peer::writing);
  if (op.status != OpStatus::kPending) return;
  // Still queued: finish it from a private copy, so the peer receives exactly the
  // stream it expects (dropping or truncating a frame would desynchronise it).
  op.owned.assign(op.data, op.data + op.bytes);
  op.data = op.owned.data();
  op.status = OpStatus::kFailed;
  op.failure = Failure{ErrorKind::kAborted, "request dropped before completion"};
}

// Writes the frames queued on every backlogged peer nobody is writing to now, and adds
// each such peer to `watched`: this thread then polls its socket for space and the
// loop stops watching it (out_watchers > 0). True if any bytes left. Caller holds mu_;
// flush_locked drops it.
bool Core::write_backlog_locked(std::unique_lock<std::mutex>& lk, std::vector<Peer*>& watched) {
  if (backlog_.empty()) return false;
  std::erase_if(backlog_, [](Peer* q) {
    bool keep = !q->sendq.empty() && !q->failure;
    if (!keep) q->in_backlog = false;
    return !keep;
  });
  bool progress = false;
  std::vector<Peer*> now = backlog_;  // flush_locked drops the lock: backlog_ may change
  for (Peer* q : now) {
    if (q->sendq.empty() || q->failure) continue;
    if (std::find(watched.begin(), watched.end(), q) == watched.end()) {
      watched.push_back(q);
      ++q->out_watchers;
      set_write_side_locked(*q, WriteSide::kCallers);
    }
    if (!q->writing) progress |= flush_locked(*q, lk, /*watching=*/true) > 0;
  }
  return progress;
}

void Core::queue_control_locked(Peer& p, frame::Type type, std::vector<std::uint8_t> payload) {
  auto op = std::make_shared<SendOp>();
  op->type = type;
  op->owned = std::move(payload);
  op->data = op->owned.data();
  op->bytes = op->owned.size();
  op->status = OpStatus::kFailed;  // no request waits on it; marks it as not user-owned
  frame::encode_header(frame::Header{type, Tag{}, op->bytes}, op->header);
  p.sendq.push_back(std::move(op));
}

// Writes queued frames until the socket is full or the queue is empty, and returns the
// bytes written. Any thread; may drop and retake the lock around sendmsg(). Frames left
// over put `p` on backlog_ and, unless `watching` (a caller in drive_locked that polls
// the socket itself), make the loop their writer (EPOLLOUT) so it finishes them.
std::size_t Core::flush_locked(Peer& p, std::unique_lock<std::mutex>& lk, bool watching) {
  std::size_t total = 0;
  if (p.writing) {
    // Another thread is writing; it hands the socket to the loop itself if the socket fills
    // up (or watches it from drive_locked). Taking it from the loop here stops a
    // level-triggered EPOLLOUT from spinning the loop meanwhile.
    set_write_side_locked(p, WriteSide::kCallers);
    return total;
  }
  while (!p.writing && p.fd >= 0 && !p.failure && !p.sendq.empty()) {
    iovec iov[kMaxIov];
    int count = 0;
    std::size_t want = 0;
    for (auto& op : p.sendq) {
      if (count + 2 > kMaxIov) break;
      std::size_t w = op->written;
      if (w < frame::kHeaderBytes) {
        iov[count++] = {op->header + w, frame::kHeaderBytes - w};
        want += frame::kHeaderBytes - w;
        w = frame::kHeaderBytes;
      }
      std::size_t off = w - frame::kHeaderBytes;
      if (off < op->bytes) {
        iov[count++] = {const_cast<std::uint8_t*>(op->data) + off, op->bytes - off};
        want += op->bytes - off;
      }
    }
    p.writing = true;
    int fd = p.fd;
    lk.unlock();
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<std::size_t>(count);
    ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    int err = errno;
    lk.lock();
    p.writing = false;
    io_done_locked();
    // Account for what left first: frames fully written count as sent even if the peer
    // failed meanwhile. The rest we owned while writing, so we fail them here.
    if (n > 0) {
      advance_sends_locked(p, static_cast<std::size_t>(n));
      total += static_cast<std::size_t>(n);
    }
    if (p.failure) {
      fail_sends_locked(p, abort_ ? *abort_ : *p.failure);
      return total;
    }
    if (n < 0) {
      if (err == EINTR) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) break;
      // The peer is gone. What it sent before it went (an abort naming the cause) may
      // still wait in our receive queue: read that first, so it is what gets reported.
      if (err == EPIPE || err == ECONNRESET) drain_locked(p, lk);
      fail_peer_locked(
          p, Failure{ErrorKind::kPeerLost, "sending to rank " + std::to_string(p.rank) + " at " +
                                               p.address + " failed: " + std::strerror(err)});
      return total;
    }
    if (abort_ && !p.abort_settled) settle_sends_after_abort_locked(p, abort_send_frames_);
    if (static_cast<std::size_t>(n) < want) break;  // socket buffer full
  }
  if (p.sendq.empty()) {
    set_write_side_locked(p, WriteSide::kCallers);
  } else if (!p.writing && !p.failure) {  // socket full: wait for space
    if (!watching) set_write_side_locked(p, WriteSide::kLoop);
    if (!p.in_backlog) {
      p.in_backlog = true;
      backlog_.push_back(&p);
    }
  }
  return total;
}

void Core::advance_sends_locked(Peer& p, std::size_t n) {
  while (n > 0 && !p.sendq.empty()) {
    SendOp& op = *p.sendq.front();
    std::size_t take = std::min(n, op.total() - op.written);
    op.written += take;
    n -= take;
    if (op.written < op.total()) break;
    finish_send_locked(p, p.sendq.front());
  }
}

void Core::finish_send_locked(Peer& p, std::shared_ptr<SendOp> op) {
  p.sendq.pop_front();
  if (op->type == frame::Type::kData) {
    p.traffic.bytes_sent += op->bytes;
    p.traffic.messages_sent += 1;
  }
  if (op->status == OpStatus::kPending) complete_locked(*op);
}

void Core::fail_sends_locked(Peer& p, const Failure& f) {
  for (auto& op : p.sendq) fail_locked(*op, f);
  p.sendq.clear();
}

// After an abort nothing new is sent except the abort frame itself. A frame already
// partly written is finished from a private copy first: cutting it short would make the
// peer parse payload bytes as the abort frame's header.
void Core::settle_sends_after_abort_locked(Peer& p, bool send_frame) {
  p.abort_settled = true;
  if (p.failure) return fail_sends_locked(p, *abort_);
  std::shared_ptr<SendOp> partial;
  if (!p.sendq.empty() && p.sendq.front()->written > 0) {
    partial = p.sendq.front();
    p.sendq.pop_front();
    if (partial->owned.empty() && partial->bytes > 0) {
      partial->owned.assign(partial->data, partial->data + partial->bytes);
      partial->data = partial->owned.data();
    }
    fail_locked(*partial, *abort_);
  }
  fail_sends_locked(p, *abort_);
  if (partial) p.sendq.push_back(std::move(partial));
  if (send_frame && p.rank != abort_origin_)
    queue_control_locked(p, frame::Type::kAbort, abort_payload_);
}

}  // namespace gradsync::transport::tcp
