// How failures spread through the tcp transport (a lost connection, a local or remote
// abort, destruction) and the errors its operations report.
#include <sys/epoll.h>
#include <sys/socket.h>

#include "transport/tcp_core.h"

namespace gradsync::transport::tcp {

namespace {

// How long destruction waits for queued frames to drain (see Core::shutdown).
constexpr auto kShutdownLinger = std::chrono::seconds(1);

}  // namespace

// Stops the loop thread, then fails whatever is still pending. Idempotent.
void Core::shutdown() {
  {
    std::unique_lock lk(mu_);
    if (phase_ == Phase::kStopping) return;
    // Frames still queued (an abort frame, sends whose requests were dropped) get a
    // bounded chance to leave, so peers learn "aborted" rather than "connection lost".
    auto queued = [&] {
      for (auto& p : peers_) {
        if (p && !p->failure && !p->sendq.empty()) return true;
      }
      return false;
    };
    auto linger_end = std::chrono::steady_clock::now() + kShutdownLinger;
    while (queued() && std::chrono::steady_clock::now() < linger_end) {
      cv_.wait_for(lk, std::chrono::milliseconds(5));  // polled: a rare, bounded path
    }
    phase_ = Phase::kStopping;
  }
  if (thread_.joinable()) {
    wake();
    thread_.join();
  }
  std::lock_guard lk(mu_);
  Failure f{ErrorKind::kAborted, "the tcp transport was destroyed"};
  for (auto& p : peers_) {
    if (!p) continue;
    fail_peer_locked(*p, f);
    if (p->fd >= 0) ::shutdown(p->fd, SHUT_RDWR);
  }
}

void Core::abort(const std::string& reason) {
  std::unique_lock lk(mu_);
  if (abort_) return;
  abort_ = Failure{ErrorKind::kAborted, "rank " + std::to_string(rank_) + " aborted: " + reason};
  abort_payload_ = frame::encode_abort(frame::Abort{static_cast<std::uint32_t>(rank_), reason});
  apply_abort_locked(/*send_frames=*/true);
  for (auto& p : peers_) {
    if (p) flush_locked(*p, lk);  // best effort now; the loop finishes what does not fit
  }
}

// Local or remote abort: fail every operation on every peer; tell peers if local.
// A peer that is mid-write settles its own queue when the write returns.
void Core::apply_abort_locked(bool send_frames) {
  abort_send_frames_ = send_frames;
  for (auto& pp : peers_) {
    if (!pp) continue;
    Peer& p = *pp;
    fail_recvs_locked(p, *abort_);
    p.unexpected.clear();
    if (!p.writing) settle_sends_after_abort_locked(p, send_frames);
  }
  cv_.notify_all();
}

// The connection to `p` is unusable: sticky error for every pending and later op.
// Messages already fully received stay deliverable.
void Core::fail_peer_locked(Peer& p, const Failure& f) {
  if (p.failure) return;
  p.failure = f;
  if (p.fd >= 0) {
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, p.fd, nullptr);
    // Not closed here: the loop or a writer may still hold the number for a syscall in
    // flight, and a reused number would send our bytes to a stranger.
    ::shutdown(p.fd, SHUT_RDWR);
  }
  const Failure& reported = abort_ ? *abort_ : f;
  fail_recvs_locked(p, reported);
  if (!p.writing) fail_sends_locked(p, reported);
  cv_.notify_all();
}

Peer& Core::peer_checked(int peer, const char* what, std::size_t bytes) {
  if (peer < 0 || peer >= world_size_ || !peers_[static_cast<std::size_t>(peer)]) {
    throw Error(ErrorKind::kInvalidArgument,
                peer == rank_
                    ? std::string("cannot ") + what + " to itself"
                    : "rank " + std::to_string(peer) + " is not a peer of this tcp transport",
                rank_, peer, what, bytes);
  }
  return *peers_[static_cast<std::size_t>(peer)];
}

std::string Core::describe(const Tag& tag) const {
  return options_.format_tag ? options_.format_tag(tag) : default_format_tag(tag);
}

Failure Core::mismatch(const Tag& want, std::size_t want_bytes, const Tag& got,
                       std::size_t got_bytes) const {
  return Failure{ErrorKind::kMismatch, "expected " + describe(want) + " (" +
                                           std::to_string(want_bytes) + " bytes) but peer sent " +
                                           describe(got) + " (" + std::to_string(got_bytes) +
                                           " bytes)"};
}

}  // namespace gradsync::transport::tcp
