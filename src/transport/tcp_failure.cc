// How failures spread through the tcp transport (a lost connection, a local or remote
// abort, destruction), the errors its operations report, and the liveness probe that
// names a stopped or hung peer when a wait timed out.
#include <sys/epoll.h>
#include <sys/socket.h>

#include "transport/tcp_core.h"

namespace gradsync::transport::tcp {

namespace {

// How long destruction waits for queued frames to drain (see Core::shutdown).
constexpr auto kShutdownLinger = std::chrono::seconds(1);

// "rank 2", "ranks 1, 3".
std::string ranks_named(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(ranks[i]);
  }
  return s;
}

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
// A peer that is mid-write settles its own queue when the write returns. Messages already
// received stay deliverable: a rank still in the collective that another rank left before the
// abort takes that rank's last message from them (post_recv).
void Core::apply_abort_locked(bool send_frames) {
  abort_send_frames_ = send_frames;
  for (auto& pp : peers_) {
    if (!pp) continue;
    Peer& p = *pp;
    fail_recvs_locked(p, *abort_);
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

// Asks every connected peer what it waits on and waits up to `grace` for the answers. The
// loop thread of a live process answers at once, whatever its caller is doing; a stopped
// or hung process does not, though its kernel keeps ACKing, so that is how it shows. A
// peer that did not answer but kept sending (its answer may be queued behind a large
// message) is only said to be slow. Caller thread, after a wait timed out.
StallReport Core::explain_stall(Clock::duration grace) {
  std::unique_lock lk(mu_);
  if (abort_ || phase_ != Phase::kRunning) return {};
  const std::uint64_t nonce = ++probe_nonce_;
  struct Asked {
    Peer* peer;
    std::uint64_t motion;
  };
  std::vector<Asked> asked;
  for (auto& pp : peers_) {
    if (!pp || pp->failure || !pp->ready()) continue;
    pp->probe_answer.reset();
    queue_control_locked(*pp, frame::Type::kProbe, frame::encode_probe({nonce, {}}));
    asked.push_back({pp.get(), motion_locked(*pp)});
  }
  for (Asked& a : asked) {
    // As a send does: the loop, if it is already this socket's writer, writes it after what
    // is queued before it.
    if (a.peer->write_side != WriteSide::kLoop) flush_locked(*a.peer, lk);
  }
  const auto start = Clock::now();
  cv_.wait_until(lk, start + grace, [&] {
    if (abort_) return true;
    for (Asked& a : asked) {
      if (!a.peer->probe_answer && !a.peer->failure) return false;
    }
    return true;
  });
  const auto waited =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
  std::vector<int> silent, slow;
  std::string answers, addresses;
  for (Asked& a : asked) {
    const Peer& p = *a.peer;
    if (p.probe_answer) {
      answers += "; rank " + std::to_string(p.rank) + " " + *p.probe_answer;
    } else if (p.failure) {
      continue;  // lost meanwhile: its own error names it
    } else if (motion_locked(p) != a.motion) {
      slow.push_back(p.rank);
    } else {
      silent.push_back(p.rank);
      addresses += (addresses.empty() ? " at " : ", ") + p.address;
    }
  }
  StallReport report;
  const std::string within = " within " + std::to_string(waited) + " ms";
  if (!silent.empty()) {
    report.detail = ranks_named(silent) + addresses + (silent.size() == 1 ? " does" : " do") +
                    " not answer (no reply to a liveness probe" + within +
                    ", nothing received meanwhile): stopped or hung?";
  }
  if (!slow.empty()) {
    report.detail += std::string(report.detail.empty() ? "" : "; ") + ranks_named(slow) +
                     " did not answer a liveness probe" + within + " but kept sending";
  }
  if (!answers.empty()) {
    report.detail += report.detail.empty() ? answers.substr(2) : answers;
  }
  // An abort that cut the wait short early leaves a rank not heard from yet unproven.
  if (!abort_ || Clock::now() - start >= grace / 2) report.silent = std::move(silent);
  return report;
}

// What this rank waits on, for a peer's probe: the call of its oldest pending operation and
// the peers of its pending operations; or that it waits on none (it is behind, or busy
// elsewhere), with the call of its last operation.
std::string Core::status_locked() const {
  std::optional<Tag> call;
  std::vector<int> from, to;
  for (const auto& pp : peers_) {
    if (!pp) continue;
    const Peer& p = *pp;
    const RecvOp* arriving = p.in.claimed.get();
    const RecvOp* recv = arriving && arriving->status == OpStatus::kPending ? arriving : nullptr;
    for (const auto& op : p.posted) {
      if (recv) break;
      if (op->status == OpStatus::kPending && !op->abandoned) recv = op.get();
    }
    if (recv) {
      from.push_back(p.rank);
      if (!call) call = recv->tag;
    }
    for (const auto& op : p.sendq) {
      if (op->type != frame::Type::kData || op->status != OpStatus::kPending) continue;
      to.push_back(p.rank);
      if (!call) call = op->tag;
      break;
    }
  }
  if (!call && timed_out_ && last_tag_ && timed_out_->tag == *last_tag_) {
    // Its own wait timed out just now, and dropped its requests on the way out.
    return "timed out in " + describe(timed_out_->tag) + " waiting " +
           (timed_out_->send ? "for rank " + std::to_string(timed_out_->peer) + " to take its send"
                             : "for a message from rank " + std::to_string(timed_out_->peer));
  }
  if (!call) {
    return "waits on no tcp peer" +
           (last_tag_ ? " (its last tcp operation was in " + describe(*last_tag_) + ")"
                      : std::string(" (it has not sent or received over tcp yet)"));
  }
  std::string s = "waits in " + describe(*call) + " for ";
  if (!from.empty()) s += "a message from " + ranks_named(from);
  if (!from.empty() && !to.empty()) s += " and for ";
  if (!to.empty()) s += ranks_named(to) + " to take its send";
  return s;
}

// Changes whenever bytes arrive from `p`. Only what it sends counts: a stopped process's
// kernel still takes in what we send it, until its buffers fill.
std::uint64_t Core::motion_locked(const Peer& p) const {
  return p.traffic.bytes_received + p.traffic.messages_received + p.in.hdr_got + p.in.got;
}

// Answers a probe. Called from inside a read, so the loop writes the answer (EPOLLOUT), or
// the thread in sendmsg for this socket does when it comes back for the rest of the queue.
void Core::on_probe_locked(Peer& p, std::span<const std::uint8_t> payload) {
  auto probe = frame::parse_probe(payload);
  if (!probe || abort_ || p.failure) return;  // after an abort, only the abort frame is sent
  queue_control_locked(p, frame::Type::kProbeAnswer,
                       frame::encode_probe({probe->nonce, status_locked()}));
  if (!p.writing) set_write_side_locked(p, WriteSide::kLoop);
}

void Core::on_probe_answer_locked(Peer& p, std::span<const std::uint8_t> payload) {
  auto answer = frame::parse_probe(payload);
  if (!answer || answer->nonce != probe_nonce_) return;  // late: an earlier probe's
  p.probe_answer = std::move(answer->status);
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
