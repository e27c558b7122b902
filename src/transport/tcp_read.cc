// The read side of the tcp transport: posting receives, reading frames off a socket, giving
// data to its receive (or keeping it as unexpected), acting on hello and abort frames.
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

#include "transport/tcp_core.h"

namespace gradsync::transport::tcp {

namespace {

// Payload remainders at least this large are read straight into their destination; smaller
// ones, and headers, go through the staging buffer (see kStageBytes).
constexpr std::size_t kDirectReadMin = 16 * 1024;

}  // namespace

std::shared_ptr<RecvOp> Core::post_recv(int peer, const Tag& tag, void* data, std::size_t bytes,
                                        bool consume) {
  auto op = std::make_shared<RecvOp>();
  op->tag = tag;
  op->data = static_cast<std::uint8_t*>(data);
  op->bytes = bytes;
  op->consume = consume;
  std::unique_lock lk(mu_);
  Peer& p = peer_checked(peer, "recv", bytes);
  last_tag_ = tag;
  // A message that arrived is taken even after an abort (apply_abort_locked); one that does
  // not match then belongs to a call its sender began before it saw the abort, which is
  // what this receive reports.
  if (!p.unexpected.empty()) {
    Unexpected u = std::move(p.unexpected.front());
    p.unexpected.pop_front();
    const std::optional<Failure> aborted = abort_;
    lk.unlock();  // the message is ours now; copy it without blocking the loop
    if (u.tag != tag || u.bytes != bytes) {
      op->status = OpStatus::kFailed;
      op->failure = aborted ? *aborted : mismatch(tag, bytes, u.tag, u.bytes);
    } else if (consume) {
      op->owned = std::move(u.data);
      op->data = op->owned.get();
      op->received = bytes;
      op->status = OpStatus::kDone;
    } else {
      if (bytes) std::memcpy(data, u.data.get(), bytes);
      op->received = bytes;
      op->status = OpStatus::kDone;
    }
    return op;
  }
  // While a peer's abort waits to be applied, a receive may still take what is read first.
  if (abort_ && !peer_abort_unapplied_) throw error_of(*abort_, peer, "recv", bytes);
  if (p.failure) throw error_of(*p.failure, peer, "recv", bytes);
  p.posted.push_back(op);
  return op;
}

void Core::abandon(RecvOp& op, int peer) {
  std::unique_lock lk(mu_);
  Peer& p = wait_out_syscall_locked(lk, peer, &Peer::reading);
  if (op.status != OpStatus::kPending) return;
  op.abandoned = true;
  op.status = OpStatus::kFailed;
  if (op.claimed) {  // the message now arriving was headed for its buffer: discard the rest
    op.claimed = false;
    p.in.claimed.reset();
    p.in.drain = true;
  }
  // Otherwise it stays in `posted` to keep its place in the FIFO; its message is drained.
}

// One recv() from `p`, straight into the arriving message's destination when much of it
// is left, else into `stage` (headers, small messages), then the processing of what
// arrived. Only the thread that reads `p` calls this: the loop, or the caller that set
// read_side kDriven. Caller holds mu_; it is dropped around the syscall, with p.reading set
// so nobody frees or fails the destination meanwhile.
ReadStep Core::read_once_locked(Peer& p, std::unique_lock<std::mutex>& lk, std::uint8_t* stage) {
  const ReadStep step = read_frames_locked(p, lk, stage);
  // After the frames are processed, so `stage` is free and no peer's stream is half parsed.
  if (peer_abort_unapplied_) apply_peer_abort_locked(lk, stage);
  return step;
}

ReadStep Core::read_frames_locked(Peer& p, std::unique_lock<std::mutex>& lk, std::uint8_t* stage) {
  for (;;) {
    if (p.failure || p.fd < 0) return ReadStep::kClosed;
    if (p.reading) return ReadStep::kDrained;  // another thread is reading it (a sweep)
    Incoming& in = p.in;
    if (!in.in_header) claim_locked(p);
    std::size_t remaining = in.in_header ? 0 : in.h.length - in.got;
    std::uint8_t* dest = nullptr;
    if (remaining >= kDirectReadMin && !in.drain) {
      dest = in.claimed ? in.claimed->data + in.got : in.buffer.get() + in.got;
    }
    const bool direct = dest != nullptr;
    const std::size_t len = direct ? remaining : kStageBytes;
    if (!direct) dest = stage;
    const int fd = p.fd;
    p.reading = true;
    lk.unlock();
    ssize_t n = ::recv(fd, dest, len, MSG_DONTWAIT);
    int err = errno;
    lk.lock();
    if (direct && n > 0) {  // bytes that arrived count, whatever happened meanwhile
      in.got += static_cast<std::size_t>(n);
      if (in.claimed) in.claimed->received = in.got;
      if (in.got == in.h.length) finish_message_locked(p);
    }
    p.reading = false;
    io_done_locked();
    // A failure or abort set by another thread during recv() (possibly why it returned
    // 0) skipped the receive we owned; settle it now.
    settle_claimed_locked(p);
    if (p.failure) return ReadStep::kClosed;
    if (n == 0) {
      if (!p.ready()) {  // the acceptor refused our hello: the likely causes are configuration
        fail_peer_locked(p, Failure{ErrorKind::kProtocol,
                                    "rank " + std::to_string(p.rank) + " at " + p.address +
                                        " closed the connection during the handshake (different "
                                        "job token or world size? see its log)"});
        return ReadStep::kClosed;
      }
      fail_peer_locked(
          p, Failure{ErrorKind::kPeerLost, "connection to rank " + std::to_string(p.rank) + " at " +
                                               p.address + " closed by the peer (EOF)"});
      return ReadStep::kClosed;
    }
    if (n < 0) {
      if (err == EAGAIN || err == EWOULDBLOCK) return ReadStep::kDrained;
      if (err == EINTR) continue;
      fail_peer_locked(
          p, Failure{ErrorKind::kPeerLost, "connection to rank " + std::to_string(p.rank) + " at " +
                                               p.address + " lost: " + std::strerror(err)});
      return ReadStep::kClosed;
    }
    auto got = static_cast<std::size_t>(n);
    if (!direct) consume_locked(p, stage, got);
    if (p.failure) return ReadStep::kClosed;
    return got < len ? ReadStep::kDrained : ReadStep::kMore;
  }
}

// After a recv() into a user buffer: a failure or abort that arrived meanwhile could not
// fail the claimed receive (we owned it), so it is done here.
void Core::settle_claimed_locked(Peer& p) {
  const Failure* f = failure_for(p);
  if (!f || !p.in.claimed) return;
  fail_locked(*p.in.claimed, *f);
  p.in.claimed->claimed = false;
  p.in.claimed.reset();
  p.in.drain = true;
}

// Processes `n` bytes read into the staging buffer: headers, payload pieces, whole
// small messages.
void Core::consume_locked(Peer& p, const std::uint8_t* data, std::size_t n) {
  Incoming& in = p.in;
  while (n > 0 && !p.failure) {
    if (in.in_header) {
      std::size_t take = std::min(n, frame::kHeaderBytes - in.hdr_got);
      std::memcpy(in.hdr + in.hdr_got, data, take);
      in.hdr_got += take;
      data += take;
      n -= take;
      if (in.hdr_got == frame::kHeaderBytes) on_header_locked(p);
      continue;
    }
    claim_locked(p);
    std::size_t take = std::min<std::size_t>(n, in.h.length - in.got);
    if (in.claimed) {
      std::memcpy(in.claimed->data + in.got, data, take);
      in.claimed->received = in.got + take;
    } else if (!in.drain) {
      std::memcpy(in.buffer.get() + in.got, data, take);
    }
    in.got += take;
    data += take;
    n -= take;
    if (in.got == in.h.length) finish_message_locked(p);
  }
}

void Core::on_header_locked(Peer& p) {
  Incoming& in = p.in;
  auto st = frame::parse_header(in.hdr, frame::kDefaultMaxDataBytes, in.h);
  auto protocol = [&](const std::string& why) {
    fail_peer_locked(
        p, Failure{ErrorKind::kProtocol, "rank " + std::to_string(p.rank) + " at " + p.address +
                                             " broke the protocol: " + why});
  };
  if (st != frame::ParseStatus::kOk) return protocol(frame::to_string(st));
  in.in_header = false;
  in.got = 0;
  in.drain = false;
  in.claimed.reset();
  in.buffer.reset();
  switch (in.h.type) {
    case frame::Type::kChallenge:
      if (p.handshake != Handshake::kHelloSent) return protocol("an unexpected challenge");
      break;
    case frame::Type::kProof:
      // Proofs go to the acceptor's pending connection, never to a peer's.
      return protocol("an unexpected proof");
    case frame::Type::kHello:
      if (p.handshake != Handshake::kProofSent) {
        return protocol(p.ready() ? "a second hello" : "a hello before its challenge");
      }
      break;
    case frame::Type::kAbort:
      break;
    case frame::Type::kProbe:
    case frame::Type::kProbeAnswer:
      if (!p.ready()) return protocol("a probe before the handshake");
      break;
    case frame::Type::kData:
      if (!p.ready()) return protocol("data before the handshake");
      if (abort_ && !peer_abort_unapplied_) {
        in.drain = true;  // aborted: nobody will ever receive it
      } else if (!p.posted.empty()) {
        claim_locked(p);
      }
      break;
  }
  if (!in.claimed && !in.drain && in.h.length > 0) {
    in.buffer = pool_.get(in.h.length);
    if (!in.buffer) {
      fail_peer_locked(
          p, Failure{ErrorKind::kSystem, "cannot buffer a " + std::to_string(in.h.length) +
                                             "-byte message from rank " + std::to_string(p.rank) +
                                             ": out of memory"});
      return;
    }
  }
  if (in.h.length == 0) finish_message_locked(p);
}

// Gives the data message now arriving to the oldest posted receive, if any. Called at
// the header and again before each read, so a receive posted late takes over the rest
// of the message directly (only the prefix already buffered is copied).
void Core::claim_locked(Peer& p) {
  Incoming& in = p.in;
  if (in.in_header || in.h.type != frame::Type::kData || in.claimed || in.drain) return;
  if (p.posted.empty() || !p.unexpected.empty()) return;
  std::shared_ptr<RecvOp> op = std::move(p.posted.front());
  p.posted.pop_front();
  if (op->abandoned || op->status != OpStatus::kPending) {
    in.drain = true;
  } else if (op->tag != in.h.tag || op->bytes != in.h.length) {
    fail_locked(*op, mismatch(op->tag, op->bytes, in.h.tag, in.h.length));
    in.drain = true;
  } else {
    if (op->consume) {
      // Take over the arriving message's buffer (or make one if nothing has arrived).
      if (!in.buffer && in.h.length > 0) in.buffer = pool_.get(in.h.length);
      if (!in.buffer && in.h.length > 0) {
        fail_locked(*op,
                    Failure{ErrorKind::kSystem, "cannot allocate " + std::to_string(in.h.length) +
                                                    " bytes for a consuming receive"});
        in.drain = true;
        return;
      }
      op->owned = std::move(in.buffer);
      op->data = op->owned.get();
    } else if (in.got > 0) {
      std::memcpy(op->data, in.buffer.get(), in.got);
    }
    op->received = in.got;
    op->claimed = true;
    in.claimed = std::move(op);
  }
  in.buffer.reset();
}

void Core::finish_message_locked(Peer& p) {
  Incoming& in = p.in;
  std::span<const std::uint8_t> payload(in.buffer.get(), in.buffer ? in.h.length : 0);
  switch (in.h.type) {
    case frame::Type::kData:
      // A receive may have been posted while the last bytes were read without the lock.
      claim_locked(p);
      p.traffic.bytes_received += in.h.length;
      p.traffic.messages_received += 1;
      if (in.claimed) {
        in.claimed->claimed = false;
        in.claimed->received = in.h.length;
        complete_locked(*in.claimed);
      } else if (!in.drain) {
        p.unexpected.push_back(Unexpected{in.h.tag, std::move(in.buffer), in.h.length});
      }
      break;
    case frame::Type::kHello:
      // A refused hello fails the peer; what it was reading no longer matters.
      if (!accept_hello_locked(p, payload)) return;
      break;
    case frame::Type::kChallenge:
      if (!answer_challenge_locked(p, payload)) return;
      break;
    case frame::Type::kProof:
      break;  // refused with the header
    case frame::Type::kAbort:
      on_abort_frame_locked(p, payload);
      break;
    case frame::Type::kProbe:
      on_probe_locked(p, payload);
      break;
    case frame::Type::kProbeAnswer:
      on_probe_answer_locked(p, payload);
      break;
  }
  in.in_header = true;
  in.hdr_got = 0;
  in.got = 0;
  in.drain = false;
  in.claimed.reset();
  in.buffer.reset();
}

// The challenge of a peer we dialed: if its proof of the token holds, queues ours (the loop
// writes it); else fails the peer and returns false. A proof that does not hold is a peer
// with another token, or an impostor; either way we send nothing it could use.
bool Core::answer_challenge_locked(Peer& p, std::span<const std::uint8_t> payload) {
  auto c = frame::parse_challenge(payload);
  std::string why;
  std::vector<std::uint8_t> proof;
  try {
    const std::string bound = binding(static_cast<std::uint32_t>(rank_), p.rank);
    if (!c) {
      why = "malformed challenge";
    } else if (!net::proof_holds(c->proof, options_.token, kAcceptorRole, p.nonce, c->nonce,
                                 bound)) {
      why = "wrong job token: its proof of the token does not hold";
    } else {
      const std::string mine = net::prove(options_.token, kDialerRole, p.nonce, c->nonce, bound);
      proof.assign(mine.begin(), mine.end());
    }
  } catch (const Error& e) {
    why = e.what();
  }
  if (!why.empty()) {
    fail_peer_locked(
        p, Failure{ErrorKind::kProtocol, "handshake with rank " + std::to_string(p.rank) + " at " +
                                             p.address + " failed: " + why});
    return false;
  }
  queue_control_locked(p, frame::Type::kProof, std::move(proof));
  p.handshake = Handshake::kProofSent;
  set_write_side_locked(p, WriteSide::kLoop);
  return true;
}

// The hello a peer we dialed answers our proof with: completes the handshake, or fails the
// peer (and returns false) if it is not the peer we dialed.
bool Core::accept_hello_locked(Peer& p, std::span<const std::uint8_t> payload) {
  auto h = frame::parse_hello(payload);
  std::string why;
  if (!h) {
    why = "malformed hello";
  } else if (h->rank != static_cast<std::uint32_t>(p.rank)) {
    why = "answered as rank " + std::to_string(h->rank);
  } else if (h->world_size != static_cast<std::uint32_t>(world_size_)) {
    why = "world size " + std::to_string(h->world_size) + " != " + std::to_string(world_size_);
  }
  if (!why.empty()) {
    fail_peer_locked(
        p, Failure{ErrorKind::kProtocol, "handshake with rank " + std::to_string(p.rank) + " at " +
                                             p.address + " failed: " + why});
    return false;
  }
  p.handshake = Handshake::kDone;
  cv_.notify_all();
  return true;
}

// A peer aborted: the first abort fails everything here and is passed on, once the frames
// being parsed are done (read_once_locked calls apply_peer_abort_locked).
void Core::on_abort_frame_locked(Peer& p, std::span<const std::uint8_t> payload) {
  auto a = frame::parse_abort(payload);
  std::string reason = a ? a->reason : "(malformed abort frame)";
  if (abort_) return;
  abort_ = Failure{ErrorKind::kAborted, "rank " + std::to_string(p.rank) + " aborted: " + reason};
  // Passed on to every other peer. The aborter's own frame to some rank may wait
  // behind data in a full socket; a rank that exits after this abort would then
  // show that rank a lost connection (EOF) before the cause arrives. Relayed, the
  // cause travels ahead of the exit on the same stream.
  abort_payload_ =
      frame::encode_abort(frame::Abort{static_cast<std::uint32_t>(rank_), abort_->detail});
  abort_origin_ = p.rank;
  peer_abort_unapplied_ = true;
}

// Fails what the recorded peer abort ends, after reading what the other peers had already
// sent: the last message of a collective a faster rank left before the abort may still be
// unread in the kernel (its socket parked, or this rank's reader descheduled), and the
// receive waiting for it completes rather than failing. What arrives later fails: the abort
// ends the wait for it.
void Core::apply_peer_abort_locked(std::unique_lock<std::mutex>& lk, std::uint8_t* stage) {
  if (peer_abort_sweeping_) return;  // a read inside the sweep below
  peer_abort_sweeping_ = true;
  sweep_locked(lk, stage);
  peer_abort_sweeping_ = false;
  peer_abort_unapplied_ = false;
  apply_abort_locked(/*send_frames=*/true);
  for (auto& q : peers_) {  // the loop writes them (we may be deep in a read here)
    if (q && !q->failure && !q->sendq.empty()) set_write_side_locked(*q, WriteSide::kLoop);
  }
}

void Core::fail_recvs_locked(Peer& p, const Failure& f) {
  for (auto& op : p.posted) fail_locked(*op, f);
  p.posted.clear();
  if (p.in.claimed && !p.reading) {  // if reading, the loop settles it after its recv()
    fail_locked(*p.in.claimed, f);
    p.in.claimed->claimed = false;
    p.in.claimed.reset();
    p.in.drain = true;
  }
}

}  // namespace gradsync::transport::tcp
