// Progress in the tcp transport: which thread does a peer's socket I/O, and when: a caller
// waiting on a request (drive_locked), or the loop thread for everything nobody waits on.
#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>

#include <algorithm>
#include <cerrno>
#include <type_traits>

#include "transport/tcp_core.h"

namespace gradsync::transport::tcp {

namespace {

// Reads per readiness event on one peer before serving the others (fairness).
constexpr int kReadsPerEvent = 32;
// A socket a caller read stays with callers this long after its last wait before the
// loop reads it again (see Core::drive_locked); also the loop's tick while any is parked.
constexpr auto kParkedReclaim = std::chrono::milliseconds(10);

// Each thread that waits in Core::drive_locked sleeps in poll() on its own eventfd as well,
// so that another thread settling the operation it waits for can wake it.
struct ThreadWaker {
  int fd = -1;
  ~ThreadWaker() {
    if (fd >= 0) ::close(fd);
  }
};
thread_local ThreadWaker t_waker;
int thread_waker() {  // -1 if no eventfd could be made (drive_locked then polls in slices)
  if (t_waker.fd < 0) t_waker.fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  return t_waker.fd;
}

// True on a transport's loop thread (each serves one Core).
thread_local bool t_in_loop_thread = false;

// A caller's staging buffer, like the loop's Core::stage_: only used within one
// read_once_locked, so one per thread serves every transport.
std::uint8_t* caller_stage() {
  thread_local std::unique_ptr<std::uint8_t[]> stage(new std::uint8_t[kStageBytes]);
  return stage.get();
}

}  // namespace

int current_thread_waker() {
  return t_waker.fd;
}

// What one drive_locked call holds while it drives.
struct Core::Drive {
  explicit Drive(Peer& t) : target(t) {}
  Peer& target;                // the peer of the operation waited for
  bool reads_target = false;   // this thread reads `target` (a receive on a live socket)
  std::vector<Peer*> driven;   // read sides this thread reads
  std::vector<Peer*> watched;  // write sides this thread writes (see write_backlog_locked)
  std::vector<pollfd> fds;
  std::vector<Peer*> polled;  // polled[i] owns fds[i]
  std::uint8_t* stage = nullptr;
  int waker = -1;
};

template <typename Op>
void Core::wait(Op& op, int peer, const char* what,
                std::chrono::steady_clock::time_point deadline) {
  std::unique_lock lk(mu_);
  Peer& p = *peers_[static_cast<std::size_t>(peer)];
  if (op.status == OpStatus::kPending) drive_locked(op, p, lk, deadline);
  if (check_locked(op, peer, what)) return;
  std::size_t done = progress(op);
  timed_out_ = TimedOut{op.tag, peer, std::strcmp(what, "send") == 0};
  throw Error(ErrorKind::kTimeout,
              std::string(what) + " of " + describe(op.tag) +
                  (std::strcmp(what, "send") == 0 ? " to" : " from") + " rank " +
                  std::to_string(peer) + " at " + p.address + " did not complete: " +
                  std::to_string(op.bytes - done) + " of " + std::to_string(op.bytes) +
                  " bytes still " + (std::strcmp(what, "send") == 0 ? "unsent" : "missing"),
              rank_, peer, what, op.bytes);
}

// Waits for `op` by doing the socket I/O it depends on on this thread, instead of
// sleeping until the loop thread has done it: a receive reads its peer's socket, and
// every wait writes the frames queued for any peer whose socket was full. That saves a
// wake-up and a thread hand-off per message (and per socket-buffer refill of a large
// send), the largest part of small-message latency on a loaded host. Polls without
// sleeping for spin_ first.
//
// A socket this thread read stays with callers afterwards (kParked): bytes that arrive
// before the next wait wait in the kernel for that wait to read them, rather than waking
// the loop to buffer them, and no epoll_ctl is paid per wait. So that no rank ever waits
// on a peer whose bytes nobody reads, every wait also reads every parked socket, test()
// hands them back to the loop, and the loop takes back those parked longer than
// kParkedReclaim (a rank busy elsewhere still makes progress).
//
// Caller holds mu_. Returns once `op` settled or `deadline` passed.
template <typename Op>
void Core::drive_locked(Op& op, Peer& target, std::unique_lock<std::mutex>& lk,
                        Clock::time_point deadline) {
  if constexpr (std::is_same_v<Op, RecvOp>) {
    if (!await_other_reader_locked(op, target, lk, deadline)) return;
  }
  Drive d(target);
  if constexpr (std::is_same_v<Op, RecvOp>) {
    if (!target.failure) {
      take_read_side_locked(d, target, lk);
      d.reads_target = true;
    }
  }
  take_parked_locked(d, lk);

  d.stage = caller_stage();
  d.waker = thread_waker();
  const auto spin_end = spin_.count() > 0 ? Clock::now() + spin_ : Clock::time_point::min();
  while (op.status == OpStatus::kPending) {
    bool progress = false;
    if (d.reads_target) {
      progress = read_target_locked(d, lk);
      if (op.status != OpStatus::kPending) break;
    } else {
      progress = read_driven_locked(d, lk);
    }
    progress |= write_backlog_locked(lk, d.watched);
    if (op.status != OpStatus::kPending) break;
    if (progress) continue;
    auto now = Clock::now();
    if (now >= deadline) break;
    if (now < spin_end) {
      if (spin_yield_) {  // let the ranks that share this core run between tries
        lk.unlock();
        ::sched_yield();
        lk.lock();
      }
      continue;
    }
    if (!collect_poll_set_locked(d)) {
      // Nothing here for this thread to drive: another thread is writing the frame we
      // wait for, or the loop is. Whoever finishes it notifies cv_.
      cv_.wait_until(lk, deadline, [&] { return op.status != OpStatus::kPending; });
      continue;
    }
    sleep_in_poll_locked(d, op.waker, deadline, now, lk);
    read_ready_sockets_locked(d, lk);
  }
  if (op.status == OpStatus::kFailed && op.failure.kind == ErrorKind::kPeerLost && !abort_) {
    prefer_abort_cause_locked(op.failure, lk, d.stage);
  }
  park_driven_locked(d);
  unwatch_locked(d);
}

// The two waits requests make (the facade, tcp.cc, sees only the declaration).
template void Core::wait(SendOp&, int, const char*, std::chrono::steady_clock::time_point);
template void Core::wait(RecvOp&, int, const char*, std::chrono::steady_clock::time_point);

// Another thread reads `target` for its own receive: it completes ours on the way, or
// hands the socket over when it is done. False if `op` settled or `deadline` passed
// meanwhile.
bool Core::await_other_reader_locked(RecvOp& op, Peer& target, std::unique_lock<std::mutex>& lk,
                                     Clock::time_point deadline) {
  if (!cv_.wait_until(lk, deadline, [&] {
        return op.status != OpStatus::kPending || target.read_side != ReadSide::kDriven;
      })) {
    return false;
  }
  return op.status == OpStatus::kPending;
}

// Makes this thread the reader of `q`. Taken from the loop, the socket leaves the loop's
// epoll interest, and the loop may still be in recv() on it: wait for that to end.
void Core::take_read_side_locked(Drive& d, Peer& q, std::unique_lock<std::mutex>& lk) {
  const bool from_loop = q.read_side == ReadSide::kLoop;
  set_read_side_locked(q, ReadSide::kDriven);
  d.driven.push_back(&q);
  if (from_loop) {
    if (!q.in_unloaded) {
      q.in_unloaded = true;
      unloaded_.push_back(&q);
    }
    io_wait_locked(lk, [&] { return !q.reading; });  // the loop may be in recv()
  }
}

// Takes every parked socket too, so that bytes waiting on one are read (see drive_locked).
void Core::take_parked_locked(Drive& d, std::unique_lock<std::mutex>& lk) {
  for (std::size_t i = 0; i < unloaded_.size(); ++i) {  // take() may append; none erases
    Peer& q = *unloaded_[i];
    if (q.read_side == ReadSide::kParked && !q.failure) take_read_side_locked(d, q, lk);
  }
}

// One read of the target's socket. True if there may be more.
bool Core::read_target_locked(Drive& d, std::unique_lock<std::mutex>& lk) {
  ReadStep step = read_once_locked(d.target, lk, d.stage);
  if (step == ReadStep::kClosed) d.reads_target = false;  // the op failed with the socket
  return step == ReadStep::kMore;
}

// A send has no socket of its own to read: read the parked ones as they come, as the loop
// would, so frames keep their arrival order across sockets (an abort that came before a
// peer's hang-up is seen before it). True if any may have more.
bool Core::read_driven_locked(Drive& d, std::unique_lock<std::mutex>& lk) {
  bool progress = false;
  for (Peer* q : d.driven) {
    if (!q->failure && read_once_locked(*q, lk, d.stage) == ReadStep::kMore) progress = true;
  }
  return progress;
}

// The sockets to sleep on: those this thread reads (POLLIN) and those whose backlog it
// writes (POLLOUT). False if there are none.
bool Core::collect_poll_set_locked(Drive& d) {
  d.fds.clear();
  d.polled.clear();
  for (Peer* q : d.driven) {
    if (q->failure) continue;
    d.fds.push_back({q->fd, POLLIN, 0});
    d.polled.push_back(q);
  }
  for (Peer* q : d.watched) {
    if (q->sendq.empty() || q->failure || q->writing) continue;
    auto it = std::find(d.polled.begin(), d.polled.end(), q);
    if (it != d.polled.end()) {
      d.fds[static_cast<std::size_t>(it - d.polled.begin())].events |= POLLOUT;
    } else {
      d.fds.push_back({q->fd, POLLOUT, 0});
      d.polled.push_back(q);
    }
  }
  return !d.fds.empty();
}

// Sleeps until a socket is ready, or another thread settles the op waited for (an abort,
// a failed connection, a writer that flushed our frame with its own) and raises our waker,
// which it finds in `waiter` (the op's waker). Caller holds mu_; dropped while asleep.
void Core::sleep_in_poll_locked(Drive& d, int& waiter, Clock::time_point deadline,
                                Clock::time_point now, std::unique_lock<std::mutex>& lk) {
  const int waker = d.waker;
  d.fds.push_back({waker, POLLIN, 0});  // a negative fd is ignored by poll()
  waiter = waker;
  auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now);
  if (waker < 0) left = std::min<std::chrono::nanoseconds>(left, std::chrono::milliseconds(1));
  timespec ts{static_cast<time_t>(left.count() / 1000000000),
              static_cast<long>(left.count() % 1000000000)};
  lk.unlock();
  ::ppoll(d.fds.data(), d.fds.size(), &ts, nullptr);
  if (d.fds.back().revents & POLLIN) {
    std::uint64_t v;
    [[maybe_unused]] ssize_t n = ::read(waker, &v, sizeof v);
  }
  lk.lock();
  waiter = -1;
}

// Other driven sockets with bytes (or a hang-up) after the sleep: read them now. The
// target is read at the top of drive_locked's loop; writable sockets are written there too.
void Core::read_ready_sockets_locked(Drive& d, std::unique_lock<std::mutex>& lk) {
  for (std::size_t i = 0; i + 1 < d.fds.size(); ++i) {
    Peer* q = d.polled[i];
    if ((d.reads_target && q == &d.target) || !(d.fds[i].revents & (POLLIN | POLLHUP | POLLERR)))
      continue;
    if (q->read_side != ReadSide::kDriven || q->failure) continue;
    for (int k = 0; k < kReadsPerEvent; ++k) {
      if (read_once_locked(*q, lk, d.stage) != ReadStep::kMore) break;
    }
  }
}

// A lost connection is often the consequence of an abort already waiting in another
// socket (its sender's peer exited after it), and the abort names the root cause, which is
// what every later operation reports too (see failure_for): look for it, and report it.
void Core::prefer_abort_cause_locked(Failure& failure, std::unique_lock<std::mutex>& lk,
                                     std::uint8_t* stage) {
  sweep_locked(lk, stage);
  if (abort_) failure = *abort_;
}

// The read sides this thread drove stay with callers (kParked) until the next wait or
// until the loop takes them back.
void Core::park_driven_locked(Drive& d) {
  if (d.driven.empty()) return;
  const auto now = Clock::now();
  for (Peer* q : d.driven) {
    set_read_side_locked(*q, ReadSide::kParked);
    q->parked_since = now;
  }
  cv_.notify_all();    // a thread waiting on another receive from `target` may read now
  if (loop_sleeps_) {  // it must tick to take parked sockets back (see reclaim_locked)
    loop_sleeps_ = false;
    wake();
  }
}

// The last caller to stop watching a socket with frames still queued hands it to the loop.
void Core::unwatch_locked(Drive& d) {
  for (Peer* q : d.watched) {
    if (--q->out_watchers == 0 && !q->sendq.empty()) set_write_side_locked(*q, WriteSide::kLoop);
  }
}

// Reads what has arrived on `p`'s socket, unless another thread is reading it. Any
// thread; caller holds mu_ (dropped around the syscalls).
void Core::drain_locked(Peer& p, std::unique_lock<std::mutex>& lk) {
  std::uint8_t* stage = t_in_loop_thread ? stage_.data() : caller_stage();
  while (read_once_locked(p, lk, stage) == ReadStep::kMore) {
  }
}

// Reads whatever has already arrived on every socket nobody is reading at this moment.
// Caller holds mu_ (dropped around the syscalls). Rare: only after a connection loss.
void Core::sweep_locked(std::unique_lock<std::mutex>& lk, std::uint8_t* stage) {
  std::vector<pollfd> fds;
  std::vector<Peer*> ps;
  for (auto& q : peers_) {
    if (!q || q->failure || q->fd < 0 || q->reading || !q->ready()) continue;
    fds.push_back({q->fd, POLLIN, 0});
    ps.push_back(q.get());
  }
  lk.unlock();
  ::poll(fds.data(), fds.size(), 0);
  lk.lock();
  for (std::size_t i = 0; i < fds.size(); ++i) {
    if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    while (read_once_locked(*ps[i], lk, stage) == ReadStep::kMore) {
    }
  }
}

// Hands parked read sides back to the loop: all of them (`all`), or those parked for
// kParkedReclaim. Caller holds mu_.
void Core::reclaim_locked(bool all) {
  const auto now = Clock::now();
  std::erase_if(unloaded_, [&](Peer* q) {
    if (q->read_side == ReadSide::kParked && !q->failure &&
        (all || now - q->parked_since >= kParkedReclaim)) {
      set_read_side_locked(*q, ReadSide::kLoop);
    }
    bool keep = q->read_side != ReadSide::kLoop && !q->failure;
    if (!keep) q->in_unloaded = false;
    return !keep;
  });
}

// Registers with epoll what the loop now watches on `p`'s socket (see set_read_side_locked).
void Core::watch_events_locked(Peer& p) {
  const bool in = p.read_side == ReadSide::kLoop;
  const bool out = p.write_side == WriteSide::kLoop;
  epoll_event ev{};
  ev.events = (in ? EPOLLIN : 0u) | (out ? EPOLLOUT : 0u);
  // With nothing watched, epoll still reports a hang-up or error, level-triggered: report
  // it once, or the loop would spin while a caller reads the socket.
  if (!in && !out) ev.events = EPOLLET;
  ev.data.u64 = kPeerIdBase + static_cast<std::uint64_t>(p.rank);
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, p.fd, &ev);
}

// --- loop thread ----------------------------------------------------------------------

void Core::loop() {
  t_in_loop_thread = true;
  try {
    run_loop();
  } catch (const std::exception& e) {
    // Last resort (e.g. out of memory): fail every peer rather than terminate.
    std::unique_lock lk(mu_);
    Failure f{ErrorKind::kSystem, std::string("tcp transport loop failed: ") + e.what()};
    for (auto& p : peers_) {
      if (p) fail_peer_locked(*p, f);
    }
  }
}

void Core::run_loop() {
  epoll_event events[64];
  for (;;) {
    int n = ::epoll_wait(epoll_.get(), events, 64, reclaim_and_pick_timeout());
    if (n < 0 && errno != EINTR) {
      std::unique_lock lk(mu_);
      Failure f{ErrorKind::kSystem, std::string("epoll_wait failed: ") + std::strerror(errno)};
      for (auto& p : peers_) {
        if (p) fail_peer_locked(*p, f);
      }
      return;
    }
    for (int i = 0; i < n; ++i) {
      std::uint64_t id = events[i].data.u64;
      if (id == kWakeId) {
        if (!on_wake()) return;
      } else if (id == kListenerId) {
        if (listener_.valid()) accept_pending();
      } else if (id >= kPendingIdBase) {
        on_pending(id);
      } else {
        Peer& p = *peers_[static_cast<std::size_t>(id - kPeerIdBase)];
        if (events[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP)) on_readable(p, events[i].events);
        if (events[i].events & EPOLLOUT) {
          std::unique_lock lk(mu_);
          flush_locked(p, lk);
        }
      }
    }
    if (!pending_.empty()) refuse_overdue_pending();
  }
}

// Before each epoll_wait: takes back the parked sockets that are due, and returns how long
// the loop may sleep (milliseconds, -1 for no limit). Strays' hello deadlines and parked
// sockets need a tick.
int Core::reclaim_and_pick_timeout() {
  int timeout = pending_.empty() ? -1 : 100;
  std::lock_guard lk(mu_);
  if (!unloaded_.empty()) {
    reclaim_locked(/*all=*/false);
    constexpr int kTick = static_cast<int>(kParkedReclaim.count());
    if (!unloaded_.empty()) timeout = timeout < 0 ? kTick : std::min(timeout, kTick);
  }
  loop_sleeps_ = timeout < 0;
  return timeout;
}

// The loop was woken on purpose. False: the transport is being destroyed, the loop ends.
bool Core::on_wake() {
  std::uint64_t v;
  [[maybe_unused]] ssize_t r = ::read(wake_.get(), &v, sizeof v);
  std::lock_guard lk(mu_);
  if (phase_ == Phase::kStopping) return false;
  if (phase_ == Phase::kRunning && listener_.valid()) {
    close_listener();  // real peers are all here; close the door on strays
  }
  return true;
}

void Core::on_readable(Peer& p, std::uint32_t events) {
  std::unique_lock lk(mu_);
  if (p.read_side == ReadSide::kParked && (events & (EPOLLERR | EPOLLHUP))) {
    set_read_side_locked(p, ReadSide::kLoop);  // hung up while parked: read the end now
  }
  for (int iter = 0; iter < kReadsPerEvent; ++iter) {
    // A caller waiting on a receive from `p` reads it itself (see drive_locked).
    if (p.read_side != ReadSide::kLoop || p.reading) return;
    if (read_once_locked(p, lk, stage_.data()) != ReadStep::kMore) return;
  }
}

}  // namespace gradsync::transport::tcp
