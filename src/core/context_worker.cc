// The context's worker thread: the queue of async calls, run in issue order, with the
// point-to-point calls it keeps in flight between them (context_p2p.cc), and the drain a
// blocking call waits in.
#include <algorithm>
#include <chrono>
#include <thread>

#include "core/context_impl.h"
#include "core/handoff_spin.h"

namespace gradsync {

namespace {
// How long the worker sleeps between tests of point-to-point calls in flight while it must
// stay ready to post the next one. Progress keeps the sleeps short: shm moves bytes only
// inside tests (a ring of 2 MiB takes a few hundred microseconds to drain); idle calls back
// off towards a millisecond, so a receive posted long before its send costs next to nothing.
// A new call ends the sleep at once (queue_cv_).
// While a thread waits for one of the calls in flight (`awaited`), the worker is that thread's
// only way forward, so it tests longer before it sleeps: a message that needs both ranks to
// progress it several times (UCX's rendezvous) otherwise paid a sleep of up to 1 ms per step.
class PollBackoff {
 public:
  void record(bool progressed, bool awaited) {
    idle_ = progressed ? 0 : idle_ + 1;
    retries_ = awaited ? kAwaitedRetries : kRetries;
  }
  // Zero: test again at once (after a yield).
  std::chrono::microseconds next() const {
    if (idle_ < retries_) return std::chrono::microseconds(0);
    const int doublings = std::min(idle_ - retries_, 5);
    return kShortest * (1 << doublings);  // 32 us .. 1 ms
  }

 private:
  static constexpr int kRetries = 16;
  // A test and a yield each: a few hundred microseconds in all.
  static constexpr int kAwaitedRetries = 256;
  static constexpr std::chrono::microseconds kShortest{32};
  int idle_ = 0;
  int retries_ = kRetries;
};
}  // namespace

void Context::Impl::worker_loop() {
  PollBackoff backoff;
  for (;;) {
    Task task;
    bool have_task = false, block = false;
    {
      std::unique_lock lock(queue_mu_);
      auto something_to_do = [&] { return stopping_ || draining_ > 0 || !queue_.empty(); };
      if (in_flight_.empty()) {
        if (queue_.empty() && !stopping_) {
          const std::uint64_t seen = enqueued_.load(std::memory_order_relaxed);
          lock.unlock();
          detail::spin_until([&] { return enqueued_.load(std::memory_order_acquire) != seen; });
          lock.lock();
        }
        queue_cv_.wait(lock, [&] { return stopping_ || (!queue_.empty() && !running_here_); });
        if (queue_.empty()) return;  // stopping with nothing left
      } else if (!something_to_do()) {
        const auto pause = backoff.next();
        if (pause.count() > 0) {
          queue_cv_.wait_for(lock, pause, [&] { return something_to_do() || awaited_news_; });
          awaited_news_ = false;
        } else {
          lock.unlock();
          std::this_thread::yield();
          lock.lock();
        }
      }
      // A point-to-point call is posted even while others are in flight; any other call
      // runs once they are all complete (they were issued before it).
      // Not while a waiting thread runs a call (run_if_next): the next one must wait for it.
      if (!queue_.empty() && !running_here_ && (in_flight_.empty() || queue_.front().p2p)) {
        task = std::move(queue_.front());
        queue_.pop_front();
        have_task = true;
      } else {
        // Nothing may be posted before the calls in flight complete (a collective is next,
        // a blocking call waits, or the context closes): wait for them in the transport.
        block = something_to_do();
      }
      busy_ = true;
    }
    {
      std::lock_guard exec(exec_mu_);
      if (!have_task) {
        const bool progressed = progress_p2p(block);
        backoff.record(progressed, flight_awaited());
      } else if (task.p2p) {
        start_p2p(task);
        // Test the new call at once, however long the others idled.
        backoff.record(true, flight_awaited());
      } else {
        execute(task);
      }
    }
    bool idle;
    {
      std::lock_guard lock(queue_mu_);
      busy_ = !in_flight_.empty();
      idle = !busy_;
    }
    if (have_task || idle) queue_cv_.notify_all();
  }
}

void Context::Impl::drain() {
  std::unique_lock lock(queue_mu_);
  auto idle = [&] { return queue_.empty() && !busy_ && !running_here_; };
  if (idle()) return;  // the common case: no wake-up for a worker with nothing to do
  ++draining_;
  queue_cv_.notify_all();  // a worker pausing between tests of calls in flight waits for them
  queue_cv_.wait(lock, idle);
  --draining_;
}

bool Context::Impl::flight_awaited() const {
  return std::any_of(in_flight_.begin(), in_flight_.end(), [](const InFlight& call) {
    return call.state->awaited.load(std::memory_order_relaxed);
  });
}

bool Context::Impl::run_if_next(Work::State* state) {
  Task task;
  {
    std::lock_guard lock(queue_mu_);
    if (busy_ && !state->awaited.exchange(true, std::memory_order_relaxed)) {
      awaited_news_ = true;  // (if it is one of the calls in flight)
      queue_cv_.notify_all();
    }
    if (!waiters_run_calls) return false;
    // busy_ false: the worker runs nothing and has no point-to-point call in flight; while
    // running_here_, it takes no call.
    if (busy_ || running_here_ || queue_.empty() || queue_.front().state.get() != state) {
      return false;
    }
    // A point-to-point call only alone: the calls behind it must be posted while it waits
    // (the peer may send to us only once it has received what we post after it).
    if (queue_.front().p2p && queue_.size() > 1) return false;
    task = std::move(queue_.front());
    queue_.pop_front();
    running_here_ = true;
  }
  run_here(task);
  return true;
}

void Context::Impl::run_here(Task& task) {
  {
    std::lock_guard exec(exec_mu_);
    if (task.p2p) {
      // A point-to-point call alone, nothing in flight, its issuer waiting for it: nothing can
      // be posted before it completes, so it waits in the transport, as the worker does once
      // nothing could be posted (context_p2p.cc), not between the worker's backed-off tests
      // (a blocking send or recv between 2 ranks on one host: 24-28 us that way, 2-6 this).
      if (auto call = post_p2p(task)) settle_p2p(*call, true);
    } else {
      execute(task);
    }
  }
  {
    std::lock_guard lock(queue_mu_);
    running_here_ = false;
  }
  queue_cv_.notify_all();  // the worker and drain() wait for running_here_
}

void Context::Impl::enqueue(Task task) {
  task.state->queued_in = this;  // before any other thread can see the state
  std::lock_guard lock(queue_mu_);
  if (!worker_.joinable()) worker_ = std::thread([this] { worker_loop(); });
  queue_.push_back(std::move(task));
  enqueued_.fetch_add(1, std::memory_order_release);
  queue_cv_.notify_all();
}

}  // namespace gradsync
