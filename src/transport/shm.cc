// Shared-memory transport for ranks on one host, whether threads or processes: per ordered
// pair of ranks a single-producer single-consumer ring of fixed-size slots in POSIX shared
// memory (shm_layout.h). Callers drive progress; idle waits spin briefly, then sleep on a
// process-shared futex (shm_group.h).
//
// Progress: every wait()/test() moves all pending operations of the transport (sends into
// free slots, posted receives out of full ones), so ranks that send to each other before they
// wait cannot deadlock. A send completes once all of it is in the ring, so a message larger
// than the ring completes only as the receiver drains it (after posting its receive).
// Failure: every error except a timeout is sticky (see ShmGroup::fail); a dead peer is noticed
// through its pid, a peer that destroyed its transport through its closed flag.
//
// Threading contract: one thread at a time posts, waits and tests (callers serialize);
// abort() and traffic() may be called from any thread. Requests must not outlive the transport.
#include "transport/shm.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "transport/shm_arena.h"
#include "transport/shm_group.h"
#include "transport/shm_layout.h"
#include "transport/shm_segment.h"

namespace gradsync::transport {

namespace shm {
namespace {

class ShmTransport;

class ShmRequest final : public Request {
 public:
  ShmRequest(ShmTransport& transport, OperationPtr op)
      : transport_(transport), op_(std::move(op)) {}
  bool test() override;
  void wait(Clock::time_point deadline) override;

 private:
  ShmTransport& transport_;
  OperationPtr op_;
};

// The message path. The group's shared arena lives in the same segments and shares the
// doorbells, the abort state and the liveness checks: the transport owns both the group and
// the arena, and hands the arena out.
class ShmTransport final : public Transport {
 public:
  ShmTransport(int rank, int world_size, std::vector<int> group, TransportOptions options)
      : group_(rank, world_size, std::move(group), std::move(options)), arena_(group_) {}

  // Collective setup; see make_shm_transport.
  void connect(Store& store, const std::string& key_prefix, std::chrono::milliseconds timeout,
               const ShmOptions& shm) {
    group_.connect(store, key_prefix, timeout, shm);
  }

  int rank() const override { return group_.rank; }
  int size() const override { return group_.world_size; }
  const char* name() const override { return "shm"; }
  SharedArena* shared_arena() override { return &arena_; }
  // Eager: a message that fits in an empty ring is copied in by isend itself.
  std::size_t buffered_send_bytes() const override { return kSlotCount * group_.layout.slot_bytes; }

  // A stopped peer process keeps its futexes and rings as they were, so only its state says
  // why nothing moves. Threads of this process and other pid namespaces cannot be looked at.
  StallReport explain_stall(Clock::duration) override {
    StallReport report;
    for (const auto& link : group_.links) {
      if (!link->pid_checkable) continue;
      const char state = process_state(link->pid);
      if (state != 'T' && state != 't') continue;
      report.silent.push_back(link->rank);
      report.detail += std::string(report.detail.empty() ? "" : "; ") + "rank " +
                       std::to_string(link->rank) + " (process " + std::to_string(link->pid) +
                       " on this host) is stopped (SIGSTOP, or held by a debugger)";
    }
    return report;
  }

  RequestPtr isend(int peer, const Tag& tag, const void* data, std::size_t bytes) override {
    PeerLink& link = link_for(peer, "isend", bytes);
    if (bytes != 0 && data == nullptr) {
      throw Error(ErrorKind::kInvalidArgument, "null send buffer", group_.rank, peer, "shm send",
                  bytes);
    }
    group_.throw_if_failed();
    group_.check_abort(peer);
    auto op = std::make_shared<Operation>();
    op->is_send = true;
    op->peer = peer;
    op->tag = tag;
    op->bytes = bytes;
    op->send_data = static_cast<const unsigned char*>(data);
    link.sends.push_back(op);
    // Eager: a message that fits in the ring's free slots is sent before isend returns.
    progress_guarded([&] { return progress_sends(link); });
    return std::make_unique<ShmRequest>(*this, std::move(op));
  }

  RequestPtr irecv(int peer, const Tag& tag, void* data, std::size_t bytes) override {
    if (bytes != 0 && data == nullptr) {
      throw Error(ErrorKind::kInvalidArgument, "null receive buffer", group_.rank, peer, "shm recv",
                  bytes);
    }
    auto op = post_receive(peer, tag, bytes);
    op->recv_data = static_cast<unsigned char*>(data);
    return std::make_unique<ShmRequest>(*this, std::move(op));
  }

  // Native zero-copy receive: `consume` reads each piece straight out of the ring slot, which
  // is released only after it returns. It runs inside whichever wait()/test() of this
  // transport makes the progress (always the single caller thread).
  RequestPtr irecv_consume(int peer, const Tag& tag, std::size_t bytes, Consumer consume) override {
    if (!consume) {
      throw Error(ErrorKind::kInvalidArgument, "empty consumer", group_.rank, peer, "shm recv",
                  bytes);
    }
    auto op = post_receive(peer, tag, bytes);
    op->consume = std::move(consume);
    return std::make_unique<ShmRequest>(*this, std::move(op));
  }

  // Any thread: touches only shared atomics, then wakes every rank so each notices at once.
  void abort(const std::string& reason) override { group_.abort(reason); }

  // Any thread.
  PeerTraffic traffic(int peer) const override {
    if (peer == group_.rank) return {};
    const PeerLink* link = peer >= 0 && peer < group_.world_size
                               ? group_.link_by_rank[static_cast<std::size_t>(peer)]
                               : nullptr;
    if (!link) {
      throw Error(ErrorKind::kInvalidArgument, "peer is not in this shm group", group_.rank, peer,
                  "shm traffic");
    }
    return PeerTraffic{link->bytes_sent.load(std::memory_order_relaxed),
                       link->bytes_received.load(std::memory_order_relaxed),
                       link->messages_sent.load(std::memory_order_relaxed),
                       link->messages_received.load(std::memory_order_relaxed)};
  }

  bool test(Operation& op) {
    if (op.complete) return true;
    group_.throw_if_failed();
    progress_all();
    if (op.complete) return true;
    if (check_abort(op)) return true;
    check_peers_alive(Clock::now());
    return false;
  }

  void wait(Operation& op, Clock::time_point deadline) {
    if (op.complete) return;
    group_.throw_if_failed();
    IdleSpin spin(group_.message_spin, group_.yield_when_idle);
    for (;;) {
      bool moved = progress_all();
      if (op.complete) return;
      if (check_abort(op)) return;
      if (moved) {
        spin.restart();
        // Traffic with other peers must not hide a deadline or a dead peer.
        auto now = Clock::now();
        if (now >= deadline) throw_timeout(op);
        if (now >= group_.next_process_check) check_peers_alive(now);
        continue;
      }
      if (spin.keep_spinning() || !spin.spun_out()) continue;
      group_.sleep_on_doorbell(deadline, kNoMember,
                               [&] { return message_wait_over(op, deadline); });
      spin.restart();
    }
  }

 private:
  // Not failed by another rank's abort yet: a message sent before it may already be in the
  // ring (the last message of a collective its sender has left, while this rank is still in
  // it); wait() takes what arrived before it looks at the abort.
  OperationPtr post_receive(int peer, const Tag& tag, std::size_t bytes) {
    PeerLink& link = link_for(peer, "irecv", bytes);
    group_.throw_if_failed();
    auto op = std::make_shared<Operation>();
    op->peer = peer;
    op->tag = tag;
    op->bytes = bytes;
    link.receives.push_back(op);
    return op;
  }

  PeerLink& link_for(int peer, const char* what, std::size_t bytes) const {
    if (peer == group_.rank) {
      throw Error(ErrorKind::kInvalidArgument, std::string(what) + " to self is not supported",
                  group_.rank, peer, "shm transport", bytes);
    }
    PeerLink* link = peer >= 0 && peer < group_.world_size
                         ? group_.link_by_rank[static_cast<std::size_t>(peer)]
                         : nullptr;
    if (!link) {
      throw Error(ErrorKind::kInvalidArgument,
                  std::string(what) + ": peer is not in this shm group", group_.rank, peer,
                  "shm transport", bytes);
    }
    return *link;
  }

  // ---- Failure ----

  [[noreturn]] void throw_timeout(const Operation& op) const {
    std::size_t missing = op.bytes - op.done_bytes;
    std::string amount =
        op.done_bytes == 0 ? "all " + std::to_string(op.bytes) + " bytes"
                           : std::to_string(missing) + " of " + std::to_string(op.bytes) + " bytes";
    std::string detail = group_.describe(op.tag) + ": " + amount + " still missing" +
                         (op.is_send ? " (the peer's ring is full: is it receiving?)" : "");
    throw Error(ErrorKind::kTimeout, detail, group_.rank, op.peer,
                op.is_send ? "shm send" : "shm recv", op.bytes);
  }

  // ---- Progress ----

  // Runs one progress step; any error it raises fails the transport. A consumer that calls
  // back into the transport gets no nested progress (the queues are mid-update); it may post
  // operations, but must not wait on them.
  template <class Step>
  bool progress_guarded(Step step) {
    if (progressing_) return false;
    progressing_ = true;
    try {
      bool moved = step();
      progressing_ = false;
      return moved;
    } catch (...) {
      progressing_ = false;
      group_.fail(std::current_exception());
    }
  }

  // Moves what can move on every link; true if anything did. Each direction of each link moves
  // at most one ring's worth of slots per pass, so a long send to one peer cannot starve the
  // receive from another (a ring all-reduce sends and receives at once, and its predecessor
  // stalls while we do not drain).
  bool progress_all() {
    return progress_guarded([&] {
      bool moved = false;
      for (auto& link : group_.links) {
        if (!link->sends.empty()) moved |= progress_sends(*link);
        if (!link->receives.empty()) moved |= progress_receives(*link);
      }
      return moved;
    });
  }

  bool progress_sends(PeerLink& link) {
    bool moved = false;
    const std::size_t slot_bytes = group_.layout.slot_bytes;
    for (std::uint32_t budget = kSlotCount; budget > 0 && !link.sends.empty(); --budget) {
      if (link.out_head - link.out_tail_seen == kSlotCount) {
        link.out_tail_seen = link.out_ring->tail.load(std::memory_order_seq_cst);
        if (link.out_head - link.out_tail_seen == kSlotCount) break;  // ring full
      }
      Operation& op = *link.sends.front();
      std::size_t slot = link.out_head % kSlotCount;
      std::size_t length = std::min(op.bytes - op.done_bytes, slot_bytes);
      SlotDescriptor& d = link.out_ring->slots[slot];
      d.tag = op.tag;
      d.message_bytes = op.bytes;
      d.offset = op.done_bytes;
      d.length = length;
      if (length)
        copy_to_shared(link.out_slots + slot * slot_bytes, op.send_data + op.done_bytes, length);
      link.out_ring->head.store(++link.out_head, std::memory_order_seq_cst);
      wake_if_sleeping(*link.segment);
      moved = true;
      op.done_bytes += length;
      link.bytes_sent.fetch_add(length, std::memory_order_relaxed);
      if (op.done_bytes == op.bytes) {
        op.complete = true;
        link.messages_sent.fetch_add(1, std::memory_order_relaxed);
        link.sends.pop_front();
      }
    }
    return moved;
  }

  bool progress_receives(PeerLink& link) {
    bool moved = false;
    const std::size_t slot_bytes = group_.layout.slot_bytes;
    for (std::uint32_t budget = kSlotCount; budget > 0 && !link.receives.empty(); --budget) {
      if (link.in_head_seen == link.in_tail) {
        link.in_head_seen = link.in_ring->head.load(std::memory_order_seq_cst);
        if (link.in_head_seen == link.in_tail) break;  // ring empty
      }
      Operation& op = *link.receives.front();
      std::size_t slot = link.in_tail % kSlotCount;
      const SlotDescriptor d = link.in_ring->slots[slot];  // copy: read the shared one once
      if (op.done_bytes == 0 && !(d.tag == op.tag && d.message_bytes == op.bytes)) {
        throw Error(ErrorKind::kMismatch,
                    "expected " + group_.describe(op.tag) + " (" + std::to_string(op.bytes) +
                        " bytes) but peer sent " + group_.describe(d.tag) + " (" +
                        std::to_string(d.message_bytes) + " bytes)",
                    group_.rank, link.rank, "shm recv", op.bytes);
      }
      if (d.offset != op.done_bytes || d.length > op.bytes - op.done_bytes ||
          d.length > slot_bytes || (d.length == 0 && op.bytes != 0)) {
        throw Error(ErrorKind::kProtocol,
                    "corrupt ring slot: piece at offset " + std::to_string(d.offset) + " of " +
                        std::to_string(d.length) + " bytes, expected offset " +
                        std::to_string(op.done_bytes),
                    group_.rank, link.rank, "shm recv", op.bytes);
      }
      const unsigned char* piece = link.in_slots + slot * slot_bytes;
      if (d.length) {
        if (op.consume) {
          op.consume(piece, d.offset, d.length);
        } else {
          std::memcpy(op.recv_data + d.offset, piece, d.length);
        }
      }
      link.in_ring->tail.store(++link.in_tail, std::memory_order_seq_cst);
      wake_if_sleeping(*link.segment);
      moved = true;
      op.done_bytes += d.length;
      link.bytes_received.fetch_add(d.length, std::memory_order_relaxed);
      if (op.done_bytes == op.bytes) {
        op.complete = true;
        link.messages_received.fetch_add(1, std::memory_order_relaxed);
        link.receives.pop_front();
      }
    }
    return moved;
  }

  // Fails `op` once any rank aborted, unless a last pass completes it: then true (see
  // ShmGroup::check_abort).
  bool check_abort(Operation& op) {
    return group_.check_abort(op.peer, [&] {
      progress_all();
      return op.complete;
    });
  }

  // wait()'s last look before sleeping: true if `op` completed or anything moved.
  bool message_wait_over(Operation& op, Clock::time_point deadline) {
    if (progress_all() || op.complete) return true;
    if (check_abort(op)) return true;
    auto now = Clock::now();
    check_peers_alive(now);
    if (op.complete) return true;  // the liveness check delivers what a departed peer left behind
    check_peers_in_arena();
    if (op.complete) return true;
    if (now >= deadline) throw_timeout(op);
    return false;
  }

  // The mirror image of the stray-message check in ShmArena::wait_over: a peer whose arena counter
  // is past ours has entered an arena collective this rank is not in (every member ends each
  // one at the same count), so what we wait for from it will never come. It published after
  // sending all it sent before, so a last pass delivers that first.
  void check_peers_in_arena() {
    const std::uint64_t mine = group_.own->arena_progress.load(std::memory_order_relaxed);
    for (auto& link : group_.links) {
      if (link->idle()) continue;
      const std::uint64_t theirs = link->segment->arena_progress.load(std::memory_order_seq_cst);
      if (theirs <= mine) continue;
      progress_all();
      if (link->idle()) continue;
      const Operation& op = link->receives.empty() ? *link->sends.front() : *link->receives.front();
      Tag their_call;
      for (int w = 0; w < 4; ++w) {
        their_call.words[w] = link->segment->arena_call[w].load(std::memory_order_relaxed);
      }
      group_.fail(std::make_exception_ptr(
          Error(ErrorKind::kMismatch,
                "rank " + std::to_string(link->rank) + " runs " + group_.describe(their_call) +
                    " in shared memory (its arena progress " + std::to_string(theirs) +
                    " is past this rank's " + std::to_string(mine) + ") while this rank " +
                    (op.is_send ? "sends it " : "waits for ") + group_.describe(op.tag) + " (" +
                    std::to_string(op.bytes) + " bytes)",
                group_.rank, link->rank, op.is_send ? "shm send" : "shm recv", op.bytes)));
    }
  }

  // Fails with kPeerLost if a peer we still wait on has closed its transport or died. Closed
  // flags are plain loads, checked every time; process ids every kLivenessInterval.
  void check_peers_alive(Clock::time_point now) {
    bool check_processes = now >= group_.next_process_check;
    if (check_processes) group_.next_process_check = now + kLivenessInterval;
    for (auto& link : group_.links) {
      if (link->idle()) continue;
      std::string what = group_.departure(*link, check_processes);
      if (what.empty()) continue;
      // A departed peer writes nothing more, so one more pass delivers all it left behind.
      progress_all();
      if (link->idle()) continue;
      const Operation& op = link->receives.empty() ? *link->sends.front() : *link->receives.front();
      std::string detail = "peer process " + std::to_string(link->pid) + " (rank " +
                           std::to_string(link->rank) + ") " + what + " with " +
                           std::to_string(op.bytes - op.done_bytes) + " of " +
                           std::to_string(op.bytes) + " bytes of " + group_.describe(op.tag) +
                           (op.is_send ? " not yet taken by it" : " not yet received");
      group_.fail(
          std::make_exception_ptr(Error(ErrorKind::kPeerLost, detail, group_.rank, link->rank,
                                        op.is_send ? "shm send" : "shm recv", op.bytes)));
    }
  }

  ShmGroup group_;            // the segments, links, failure and liveness the arena shares
  ShmArena arena_;            // destroyed first: it refers to group_
  bool progressing_ = false;  // inside progress_guarded
};

bool ShmRequest::test() {
  return transport_.test(*op_);
}
void ShmRequest::wait(Clock::time_point deadline) {
  transport_.wait(*op_, deadline);
}

}  // namespace
}  // namespace shm

std::unique_ptr<Transport> make_shm_transport(Store& store, const std::string& key_prefix, int rank,
                                              int world_size, const std::vector<int>& group,
                                              const TransportOptions& options,
                                              std::chrono::milliseconds timeout,
                                              const ShmOptions& shm) {
  auto invalid = [&](const std::string& why) {
    return Error(ErrorKind::kInvalidArgument, why, rank, Error::kNoPeer, "shm transport setup");
  };
  if (world_size <= 0 || rank < 0 || rank >= world_size) {
    throw invalid("rank " + std::to_string(rank) + " outside world of " +
                  std::to_string(world_size));
  }
  if (group.empty() || !std::is_sorted(group.begin(), group.end()) ||
      std::adjacent_find(group.begin(), group.end()) != group.end() || group.front() < 0 ||
      group.back() >= world_size) {
    throw invalid("group must be sorted distinct ranks in [0, " + std::to_string(world_size) + ")");
  }
  if (!std::binary_search(group.begin(), group.end(), rank)) {
    throw invalid("group does not contain this rank");
  }
  auto transport = std::make_unique<shm::ShmTransport>(rank, world_size, group, options);
  transport->connect(store, key_prefix, timeout, shm);
  return transport;
}

}  // namespace gradsync::transport
