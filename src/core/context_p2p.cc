// Point-to-point send and recv: their argument checks, the message numbers each ordered pair
// of ranks keeps apart from the collectives' call numbers, and how the worker keeps several
// of them in flight at once.
//
// Why in flight, not one at a time like a collective: a send may complete only once the peer
// has posted the matching receive (shm moves a message larger than its ring only as the
// receiver drains it), and the peer may post that receive behind its own send to us. A worker
// that waited for each call before posting the next would then wait forever on both ranks
// (rank 0: isend(1), irecv(1); rank 1: isend(0), irecv(0)). So the worker posts every
// point-to-point call as soon as it reaches it and completes the calls in flight by testing
// them in between; it waits on them inside the transport only once nothing could be posted
// before they complete (a collective is next, a blocking call or the destructor drains).
// Transport requests offer no wait for "any of these, or a new call": the worker tests
// instead, backing off while nothing moves (context_worker.cc, PollBackoff). A call that is
// the only one, waited for by its issuer (a blocking send or recv), is posted and waited for
// in the transport by that thread (submit_p2p, or run_if_next once queued): nothing can be
// posted before it completes. Not shown to the worker first where it can run at once: a worker
// that took it left its issuer asleep until the worker's backed-off tests saw it complete.
#include <string>

#include "core/context_impl.h"

namespace gradsync {

using collectives::CallSignature;
using collectives::CollectiveKind;

Work Context::Impl::submit_p2p(CallSignature sig, P2p p2p, bool blocking,
                               std::chrono::milliseconds call_timeout) {
  // Numbered per direction and peer: the k-th send from a to b is b's k-th receive from a,
  // whatever else either rank issues, and only they count it. The collectives' next_seq_,
  // which every rank must advance alike, stays untouched.
  std::vector<std::uint64_t>& numbers = p2p.is_send ? sent_to_ : received_from_;
  if (numbers.empty()) numbers.assign(static_cast<std::size_t>(size), 0);
  sig.seq = ++numbers[static_cast<std::size_t>(p2p.peer)];
  auto state = std::make_shared<Work::State>();
  Task task;
  task.sig = sig;
  task.state = state;
  task.timeout = call_timeout;
  task.p2p = p2p;
  if (blocking && waiters_run_calls) {
    bool alone;
    {
      std::lock_guard lock(queue_mu_);
      alone = !busy_ && !running_here_ && queue_.empty();
      running_here_ = alone;
    }
    if (alone) {
      run_here(task);
      return Work(state);
    }
  }
  enqueue(std::move(task));
  return Work(state);
}

std::string Context::Impl::describe(const InFlight& call) {
  return std::string(call.p2p.is_send ? "send to" : "recv from") + " rank " +
         std::to_string(call.p2p.peer) + ": " + collectives::describe(call.sig);
}

std::optional<Context::Impl::InFlight> Context::Impl::post_p2p(Task& task) {
  const auto limit = task.timeout.count() > 0 ? task.timeout : timeout;
  InFlight call{nullptr, task.state, transport::Clock::now() + limit, limit, *task.p2p, task.sig};
  if (failure_) {
    finish_p2p(call, Error(ErrorKind::kAborted, "communicator failed earlier: " + *failure_, rank,
                           Error::kNoPeer, describe(call)));
    return std::nullopt;
  }
  try {
    const transport::Tag tag = collectives::encode(task.sig);
    const P2p& p = call.p2p;
    call.request = p.is_send ? transport->isend(p.peer, tag, p.data, p.bytes)
                             : transport->irecv(p.peer, tag, p.data, p.bytes);
  } catch (const Error& e) {
    finish_p2p(call, fail_call(e, describe(call), limit));
    return std::nullopt;
  } catch (...) {
    finish_p2p(call, std::nullopt, std::current_exception());
    return std::nullopt;
  }
  return call;
}

void Context::Impl::start_p2p(Task& task) {
  if (auto call = post_p2p(task)) in_flight_.push_back(std::move(*call));
}

bool Context::Impl::settle_p2p(InFlight& call, bool block) {
  bool done = true;
  std::optional<Error> error;
  std::exception_ptr other;
  if (failure_) {
    // Another call failed and aborted the transport: this one cannot complete.
    error = Error(ErrorKind::kAborted, "communicator failed earlier: " + *failure_, rank,
                  Error::kNoPeer, describe(call));
  } else {
    try {
      if (block || transport::Clock::now() >= call.deadline) {
        call.request->wait(call.deadline);  // past the deadline: the transport's own timeout
      } else {
        done = call.request->test();
      }
    } catch (const Error& e) {
      error = fail_call(e, describe(call), call.limit);
    } catch (...) {
      other = std::current_exception();
    }
  }
  if (done) finish_p2p(call, std::move(error), other);
  return done;
}

bool Context::Impl::progress_p2p(bool block) {
  bool progressed = false;
  for (auto it = in_flight_.begin(); it != in_flight_.end();) {
    if (!settle_p2p(*it, block)) {
      ++it;
      continue;
    }
    it = in_flight_.erase(it);
    progressed = true;
  }
  if (progressed || in_flight_.empty()) return progressed;
  // Bytes moving for a call still in flight is progress too: a large shm message moves a ring
  // at a time, each time this rank tests.
  std::uint64_t moved = 0;
  for (const InFlight& call : in_flight_) {
    const PeerTraffic t = transport->traffic(call.p2p.peer);
    moved += t.bytes_sent + t.bytes_received;
  }
  if (moved == in_flight_bytes_moved_) return false;
  in_flight_bytes_moved_ = moved;
  return true;
}

void Context::Impl::finish_p2p(InFlight& call, std::optional<Error> error,
                               std::exception_ptr other) {
  // The request goes first: once the Work is done the caller may free the buffer, which a
  // failed request must no longer be able to touch (tcp detaches it on destruction).
  call.request.reset();
  complete_work(*call.state, std::move(error), std::move(other));
}

// ---- Context ----

namespace {

// `blocking`: the issuer waits for the call at once (Context::send and recv).
Work p2p_impl(Context::Impl& impl, bool is_send, int peer, const void* data, std::size_t count,
              DataType dtype, int tag, const CallOptions& options, bool blocking) {
  const char* name = is_send ? "send" : "recv";
  check_dtype_op(dtype, ReduceOp::kSum, impl.rank, name);
  require(
      peer != impl.rank,
      [&] {
        return "peer " + std::to_string(peer) +
               " is this rank itself (send and recv need another rank)";
      },
      impl.rank, name);
  require(
      peer >= 0 && peer < impl.size,
      [&] {
        return "peer " + std::to_string(peer) + " is not a rank (ranks are 0.." +
               std::to_string(impl.size - 1) + ")";
      },
      impl.rank, name);
  check_buffer(data, count, "data", impl.rank, name);
  CallSignature sig{
      0, CollectiveKind::kPointToPoint, dtype, ReduceOp::kSum, Algorithm::kAuto, tag, count};
  sig.fingerprint = options.fingerprint;
  // The transport only reads a send's buffer.
  const Context::Impl::P2p p2p{is_send, peer, const_cast<void*>(data), count * dtype_size(dtype)};
  return impl.submit_p2p(sig, p2p, blocking, options.timeout);
}

}  // namespace

// The blocking forms queue like the async ones and wait (or run at once where nothing else is
// queued or in flight, submit_p2p). Run inline after draining the queue, as blocking
// collectives are, they would first wait for the calls in flight: isend(peer) then a blocking
// recv(peer) on both ranks would leave each recv waiting for its own isend, which waits for
// the other rank's recv.
void Context::send(const void* data, std::size_t count, DataType dtype, int peer, int tag,
                   const CallOptions& options) {
  p2p_impl(*impl_, true, peer, data, count, dtype, tag, options, true).wait();
}
Work Context::send_async(const void* data, std::size_t count, DataType dtype, int peer, int tag,
                         const CallOptions& options) {
  return p2p_impl(*impl_, true, peer, data, count, dtype, tag, options, false);
}

void Context::recv(void* data, std::size_t count, DataType dtype, int peer, int tag,
                   const CallOptions& options) {
  p2p_impl(*impl_, false, peer, data, count, dtype, tag, options, true).wait();
}
Work Context::recv_async(void* data, std::size_t count, DataType dtype, int peer, int tag,
                         const CallOptions& options) {
  return p2p_impl(*impl_, false, peer, data, count, dtype, tag, options, false);
}

}  // namespace gradsync
