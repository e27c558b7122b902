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
// in the transport by that thread (run_if_next): nothing can be posted before it completes.
#include <string>

#include "core/context_impl.h"

namespace gradsync {

using collectives::CallSignature;
using collectives::CollectiveKind;

Work Context::Impl::submit_p2p(CallSignature sig, bool is_send, int peer, PostP2p post,
                               std::chrono::milliseconds call_timeout) {
  // Numbered per direction and peer: the k-th send from a to b is b's k-th receive from a,
  // whatever else either rank issues, and only they count it. The collectives' next_seq_,
  // which every rank must advance alike, stays untouched.
  std::vector<std::uint64_t>& numbers = is_send ? sent_to_ : received_from_;
  if (numbers.empty()) numbers.assign(static_cast<std::size_t>(size), 0);
  sig.seq = ++numbers[static_cast<std::size_t>(peer)];
  auto state = std::make_shared<Work::State>();
  Task task;
  task.sig = sig;
  task.state = state;
  task.timeout = call_timeout;
  task.post = std::move(post);
  task.peer = peer;
  task.what = std::string(is_send ? "send to" : "recv from") + " rank " + std::to_string(peer) +
              ": " + collectives::describe(sig);
  enqueue(std::move(task));
  return Work(state);
}

std::optional<Context::Impl::InFlight> Context::Impl::post_p2p(Task& task) {
  const auto limit = task.timeout.count() > 0 ? task.timeout : timeout;
  InFlight call{nullptr, task.state, transport::Clock::now() + limit,
                limit,   task.peer,  std::move(task.what)};
  if (failure_) {
    finish_p2p(call, Error(ErrorKind::kAborted, "communicator failed earlier: " + *failure_, rank,
                           Error::kNoPeer, call.what));
    return std::nullopt;
  }
  try {
    call.request = task.post(*transport, collectives::encode(task.sig));
  } catch (const Error& e) {
    finish_p2p(call, fail_call(e, call.what, limit));
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
                  Error::kNoPeer, call.what);
  } else {
    try {
      if (block || transport::Clock::now() >= call.deadline) {
        call.request->wait(call.deadline);  // past the deadline: the transport's own timeout
      } else {
        done = call.request->test();
      }
    } catch (const Error& e) {
      error = fail_call(e, call.what, call.limit);
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
    const PeerTraffic t = transport->traffic(call.peer);
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

Work p2p_impl(Context::Impl& impl, bool is_send, int peer, std::size_t count, DataType dtype,
              int tag, const CallOptions& options, Context::Impl::PostP2p post, const void* data) {
  const char* name = is_send ? "send" : "recv";
  check_dtype_op(dtype, ReduceOp::kSum, impl.rank, name);
  require(peer != impl.rank,
          "peer " + std::to_string(peer) + " is this rank itself (send and recv need another rank)",
          impl.rank, name);
  require(peer >= 0 && peer < impl.size,
          "peer " + std::to_string(peer) + " is not a rank (ranks are 0.." +
              std::to_string(impl.size - 1) + ")",
          impl.rank, name);
  check_buffer(data, count, "data", impl.rank, name);
  CallSignature sig{
      0, CollectiveKind::kPointToPoint, dtype, ReduceOp::kSum, Algorithm::kAuto, tag, count};
  sig.fingerprint = options.fingerprint;
  return impl.submit_p2p(sig, is_send, peer, std::move(post), options.timeout);
}

Work send_impl(Context::Impl& impl, const void* data, std::size_t count, DataType dtype, int peer,
               int tag, const CallOptions& options) {
  const std::size_t bytes = count * dtype_size(dtype);
  return p2p_impl(
      impl, true, peer, count, dtype, tag, options,
      [=](transport::Transport& t, const transport::Tag& sig) {
        return t.isend(peer, sig, data, bytes);
      },
      data);
}

Work recv_impl(Context::Impl& impl, void* data, std::size_t count, DataType dtype, int peer,
               int tag, const CallOptions& options) {
  const std::size_t bytes = count * dtype_size(dtype);
  return p2p_impl(
      impl, false, peer, count, dtype, tag, options,
      [=](transport::Transport& t, const transport::Tag& sig) {
        return t.irecv(peer, sig, data, bytes);
      },
      data);
}

}  // namespace

// The blocking forms queue like the async ones and wait. Run inline after draining the queue,
// as blocking collectives are, they would first wait for the calls in flight: isend(peer) then
// a blocking recv(peer) on both ranks would leave each recv waiting for its own isend, which
// waits for the other rank's recv.
void Context::send(const void* data, std::size_t count, DataType dtype, int peer, int tag,
                   const CallOptions& options) {
  send_impl(*impl_, data, count, dtype, peer, tag, options).wait();
}
Work Context::send_async(const void* data, std::size_t count, DataType dtype, int peer, int tag,
                         const CallOptions& options) {
  return send_impl(*impl_, data, count, dtype, peer, tag, options);
}

void Context::recv(void* data, std::size_t count, DataType dtype, int peer, int tag,
                   const CallOptions& options) {
  recv_impl(*impl_, data, count, dtype, peer, tag, options).wait();
}
Work Context::recv_async(void* data, std::size_t count, DataType dtype, int peer, int tag,
                         const CallOptions& options) {
  return recv_impl(*impl_, data, count, dtype, peer, tag, options);
}

}  // namespace gradsync
