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
#include "transport/ucx.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "core/knobs.h"
#include "transport/shm_segment.h"
#include "transport/tcp_tuning.h"
#include "transport/ucx_library.h"

namespace gradsync::transport {
namespace {

using namespace std::chrono_literals;

// Tag layout: kind (2 bits) | sender rank (22 bits) | sequence number (40 bits).
enum class Kind : std::uint64_t { kData = 0, kAbort = 1, kHello = 2 };
constexpr int kKindShift = 62;
constexpr int kRankShift = 40;
constexpr std::uint64_t kSeqMask = (std::uint64_t{1} << kRankShift) - 1;
constexpr std::uint64_t kKindMask = std::uint64_t{3} << kKindShift;
constexpr std::uint64_t kFullMask = ~std::uint64_t{0};
constexpr int kMaxRanks = 1 << 22;

std::uint64_t ucx_tag(Kind kind, int sender, std::uint64_t seq) {
  return (static_cast<std::uint64_t>(kind) << kKindShift) |
         (static_cast<std::uint64_t>(sender) << kRankShift) | (seq & kSeqMask);
}
int sender_of(std::uint64_t tag) {
  return static_cast<int>((tag & ~kKindMask) >> kRankShift);
}

constexpr std::uint64_t kHeaderMagic = 0x6772616473796e63ull;  // "gradsync"
struct WireHeader {
  Tag tag;
  std::uint64_t bytes = 0;
  std::uint64_t magic = kHeaderMagic;
};
static_assert(sizeof(WireHeader) == 48);

constexpr std::size_t kAbortTextMax = 4096;

std::string ucx_error(const char* what, ucs_status_t status) {
  return std::string(what) + ": " + ucx_library().ucs_status_string(status);
}

// One posted send or receive. Owned jointly by its Request and, while UCX holds it, by the
// transport (`inflight_`), so a completion that arrives after the Request was dropped still
// lands in live memory.
struct Op {
  int peer = -1;
  bool send = false;
  bool data = true;       // a data message (hellos are not counted as traffic)
  bool finished = false;  // checked and counted
  Tag tag;
  std::size_t bytes = 0;
  WireHeader header;
  ucp_dt_iov_t iov[2] = {};
  void* request = nullptr;  // UCX's, until completion
  bool done = false;
  ucs_status_t status = UCS_OK;
  std::size_t received = 0;  // bytes UCX delivered (header included)
  std::string text;          // an abort notice's own copy of its reason
};
using OpPtr = std::shared_ptr<Op>;

class UcxTransport;

// What UCX's peer-failure callback needs to find its peer.
struct EndpointContext {
  UcxTransport* transport;
  int peer;
};

class UcxTransport final : public Transport {
 public:
  UcxTransport(int rank, int world_size, const std::vector<int>& group, TransportOptions options,
               const UcxOptions& ucx);
  ~UcxTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return world_size_; }
  const char* name() const override { return "ucx"; }
  RequestPtr isend(int peer, const Tag& tag, const void* data, std::size_t bytes) override;
  RequestPtr irecv(int peer, const Tag& tag, void* data, std::size_t bytes) override;
  void abort(const std::string& reason) override;
  PeerTraffic traffic(int peer) const override;

  // Setup, in make_ucx_transport's order.
  // What peers need to reach this rank: its process and UCX worker address.
  Bytes card() const;
  void connect(int peer, const Bytes& card);
  void exchange_hellos(const std::vector<int>& peers, Clock::time_point deadline,
                       std::chrono::milliseconds timeout);
  // How waiters poll, once connect() has seen which peers share this machine's cores.
  void choose_spin(int spin_us) {
    spin_ = tcp::choose_spin(static_cast<unsigned>(1 + watched_.size()), spin_us);
  }

  bool test(Op& op);
  void wait(Op& op, Clock::time_point deadline);
  // A request dropped before it completed: its receive buffer may be gone, so UCX must not
  // fill it.
  void abandon(Op& op);

 private:
  friend struct Callbacks;
  void check_peer(int peer, const char* what) const;
  OpPtr post(int peer, bool send, const Tag& tag, void* data, std::size_t bytes, Kind kind,
             std::uint64_t seq);
  // Completes `op` (true) or throws if it failed; false while pending. Needs mu_.
  bool finish_locked(Op& op);
  [[noreturn]] void throw_failure_locked(Op& op);
  // Aborts the transport with `error` (or, if it is aborted already, quiesces it) and throws it.
  [[noreturn]] void fail_locked(const Error& error);
  void abort_locked(const std::string& reason);
  // After an abort: closes every endpoint at once and ends every receive, then progresses
  // until UCX holds no request of this rank's, so that no buffer a caller releases after the
  // error is touched again. Bounded (200 ms): if UCX still holds a request then (shared memory
  // cannot cancel a rendezvous send), the transport is frozen_.
  void quiesce_locked();
  // Progresses until every request of `requests` and of inflight_ has completed (true), or
  // deadline (false).
  bool settle_locked(const std::vector<void*>& requests, Clock::time_point deadline);
  // ucp_worker_progress, unless the transport is frozen_.
  unsigned progress_locked() { return frozen_ ? 0 : lib_.ucp_worker_progress(worker_); }
  // Ends every receive UCX still holds (abandoned ones, the standing abort receive).
  void cancel_receives_locked();
  // Messages that arrived for no receive (an abort cut the job short): taken off UCX's
  // queue, which would otherwise warn about each one as the worker goes.
  void discard_unexpected_locked(Clock::time_point deadline);
  void post_abort_receive_locked();
  void on_abort_message_locked(std::uint64_t sender_tag, std::size_t length);
  void on_peer_failure_locked(int peer, ucs_status_t status);
  // Peers UCX cannot watch (its shared memory has no peer-failure handling): their
  // processes, through pidfds that also wake a sleeping waiter.
  void check_watched_locked();
  // Progresses until every op in `ops` is done or `deadline`; true if all are.
  bool drain_locked(const std::vector<OpPtr>& ops, Clock::time_point deadline);
  std::string describe(const Tag& tag) const {
    return options_.format_tag ? options_.format_tag(tag) : default_format_tag(tag);
  }

  const UcxLibrary& lib_;
  int rank_;
  int world_size_;
  TransportOptions options_;
  tcp::SpinPolicy spin_;  // set by choose_spin()
  std::vector<bool> member_;

  mutable std::mutex mu_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int event_fd_ = -1;  // -1: the worker cannot sleep on a fd; waiters back off instead
  Bytes address_;
  std::vector<ucp_ep_h> endpoints_;
  std::vector<std::unique_ptr<EndpointContext>> endpoint_contexts_;
  std::vector<std::uint64_t> send_seq_, recv_seq_;
  std::vector<PeerTraffic> traffic_;
  std::vector<std::optional<std::string>> lost_;  // why each lost peer was lost
  std::map<Op*, OpPtr> inflight_;
  struct Watched {
    int peer;
    pid_t pid;
    int pidfd;  // -1: checked through /proc
  };
  std::vector<Watched> watched_;
  std::optional<std::string> abort_;  // sticky
  std::vector<char> abort_text_;
  OpPtr abort_receive_;
  bool quiesced_ = false;
  // An abort left requests in UCX that it could not end (a rendezvous send to a live peer over
  // shared memory, which has no forced cancel): their buffers may be released by the caller,
  // so nothing progresses the worker again and UCX never reads or fills them.
  bool frozen_ = false;

  // Background progress: a rank that waits on another transport (the shm ring of a
  // hierarchical job) still answers UCX's rendezvous for its large sends, as the tcp
  // transport's epoll thread does. It sleeps on the worker's event fd.
  void progress_loop();
  std::thread progress_thread_;
  int stop_fd_ = -1;
  bool stopping_ = false;
  Op* sleeping_on_ = nullptr;  // the op of the waiter in poll(), if one sleeps
  int wake_fd_ = -1;           // eventfd: written when that op is done, lost or aborted
  // Wakes the sleeping waiter if its op is done or its peer lost, or `always` (abort).
  void wake_waiter_locked(bool always);
};

struct Callbacks {
  static void sent(void* request, ucs_status_t status, void* user_data) {
    complete(request, status, 0, user_data);
  }
  static void received(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                       void* user_data) {
    complete(request, status, info ? info->length : 0, user_data);
  }
  static void complete(void* request, ucs_status_t status, std::size_t length, void* user_data) {
    auto* op = static_cast<Op*>(user_data);
    op->done = true;
    op->status = status;
    op->received = length;
    op->request = nullptr;
    ucx_library().ucp_request_free(request);
  }
  static void peer_failed(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* ctx = static_cast<EndpointContext*>(arg);
    ctx->transport->on_peer_failure_locked(ctx->peer, status);  // runs inside progress
  }
};

UcxTransport::UcxTransport(int rank, int world_size, const std::vector<int>& group,
                           TransportOptions options, const UcxOptions& ucx)
    : lib_(ucx_library(rank)),
      rank_(rank),
      world_size_(world_size),
      options_(std::move(options)),
      member_(static_cast<std::size_t>(world_size), false),
      endpoints_(static_cast<std::size_t>(world_size), nullptr),
      send_seq_(static_cast<std::size_t>(world_size), 0),
      recv_seq_(static_cast<std::size_t>(world_size), 0),
      traffic_(static_cast<std::size_t>(world_size)),
      lost_(static_cast<std::size_t>(world_size)),
      abort_text_(kAbortTextMax) {
  for (int r : group) member_[static_cast<std::size_t>(r)] = true;
  auto fail = [&](const char* what, ucs_status_t status) {
    throw Error(ErrorKind::kSystem, ucx_error(what, status), rank_, Error::kNoPeer, "ucx setup");
  };
  ucp_config_t* config = nullptr;
  if (auto s = lib_.ucp_config_read(nullptr, nullptr, &config); s != UCS_OK)
    fail("ucp_config_read", s);
  const auto environment = [](const std::string& name) {
    return knobs::foreign_text("UCX_" + name);
  };
  for (const auto& [name, value] : ucx_settings(ucx, environment)) {
    if (auto s = lib_.ucp_config_modify(config, name.c_str(), value.c_str()); s != UCS_OK) {
      lib_.ucp_config_release(config);
      throw Error(ErrorKind::kInvalidArgument,
                  "UCX setting " + name + "=" + value + ": " + lib_.ucs_status_string(s), rank_,
                  Error::kNoPeer, "ucx setup");
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;
  const ucs_status_t init =
      lib_.ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &params, config, &context_);
  lib_.ucp_config_release(config);
  if (init != UCS_OK) fail("ucp_init", init);

  ucp_worker_params_t worker{};
  worker.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  if (auto s = lib_.ucp_worker_create(context_, &worker, &worker_); s != UCS_OK) {
    lib_.ucp_cleanup(context_);
    fail("ucp_worker_create", s);
  }
  if (lib_.ucp_worker_get_efd(worker_, &event_fd_) != UCS_OK) event_fd_ = -1;
  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
  if (auto s = lib_.ucp_worker_query(worker_, &attr); s != UCS_OK) {
    lib_.ucp_worker_destroy(worker_);
    lib_.ucp_cleanup(context_);
    fail("ucp_worker_query", s);
  }
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(attr.address);
  address_.assign(bytes, bytes + attr.address_length);
  lib_.ucp_worker_release_address(worker_, attr.address);
  {
    std::lock_guard lock(mu_);
    post_abort_receive_locked();
  }
  stop_fd_ = ::eventfd(0, EFD_CLOEXEC);
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  progress_thread_ = std::thread([this] { progress_loop(); });
}

void UcxTransport::wake_waiter_locked(bool always) {
  if (!sleeping_on_) return;
  // Only for news the waiter needs: progress of other ops would wake it just to sleep again,
  // a context switch each on cores its peers' ranks share.
  if (!always && !sleeping_on_->done && !lost_[static_cast<std::size_t>(sleeping_on_->peer)]) {
    return;
  }
  const std::uint64_t one = 1;
  if (::write(wake_fd_, &one, sizeof one) < 0) {
    // Cannot happen on an eventfd below its limit; the waiter's nap ends anyway.
  }
}

void UcxTransport::progress_loop() {
  std::unique_lock lock(mu_);
  while (!stopping_) {
    bool progressed = false;
    while (progress_locked() != 0) progressed = true;
    if (progressed) wake_waiter_locked(false);
    // Armed, the thread sleeps until UCX has something. UCX can refuse to arm while progress
    // finds nothing to do (seen with a lost peer's shared-memory endpoint): the thread then
    // naps a millisecond without the lock, which it would otherwise hold against every caller.
    const bool armed = !frozen_ && event_fd_ >= 0 && lib_.ucp_worker_arm(worker_) != UCS_ERR_BUSY;
    if (!armed && progressed) continue;
    const int timeout_ms = armed || frozen_ ? 100 : 1;  // read under the lock
    lock.unlock();
    pollfd fds[2] = {{stop_fd_, POLLIN, 0}, {event_fd_, POLLIN, 0}};
    ::poll(fds, armed ? 2 : 1, timeout_ms);
    lock.lock();
  }
}

UcxTransport::~UcxTransport() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  const std::uint64_t one = 1;
  if (::write(stop_fd_, &one, sizeof one) < 0) {
    // Cannot happen on an eventfd below its limit; the thread's 100 ms poll ends anyway.
  }
  progress_thread_.join();
  ::close(stop_fd_);
  ::close(wake_fd_);
  std::lock_guard lock(mu_);
  // Receives nobody will wait for any more (the standing abort receive, abandoned ones).
  cancel_receives_locked();
  // A clean end then flushes what this rank sent (a peer may still be reading the last
  // message); after an abort nothing more is owed. Then every endpoint is closed at once: a
  // graceful close would wait for each peer to progress its own worker.
  if (!abort_) {
    std::vector<void*> flushing;
    ucp_request_param_t param{};
    void* flush = lib_.ucp_worker_flush_nbx(worker_, &param);
    if (UCS_PTR_IS_PTR(flush)) flushing.push_back(flush);
    settle_locked(flushing, Clock::now() + 2s);
    for (void* request : flushing) lib_.ucp_request_free(request);
  }
  quiesce_locked();
  if (!frozen_) discard_unexpected_locked(Clock::now() + 200ms);
  lib_.ucp_worker_destroy(worker_);
  lib_.ucp_cleanup(context_);
  for (const auto& w : watched_) {
    if (w.pidfd >= 0) ::close(w.pidfd);
  }
}

// A card: the process (machine, pid namespace, pid) and the UCX worker address.
struct CardHeader {
  char boot_id[40] = {};  // the machine (its boot), as the kernel names it
  std::uint64_t pid_namespace = 0;
  std::uint64_t pid = 0;
  bool same_process_space(const CardHeader& other) const {
    return std::memcmp(boot_id, other.boot_id, sizeof boot_id) == 0 &&
           pid_namespace == other.pid_namespace;
  }
};

CardHeader own_card_header() {
  CardHeader header;
  std::ifstream("/proc/sys/kernel/random/boot_id").read(header.boot_id, sizeof header.boot_id - 1);
  header.pid_namespace = shm::pid_namespace_id();
  header.pid = static_cast<std::uint64_t>(::getpid());
  return header;
}

Bytes UcxTransport::card() const {
  const CardHeader header = own_card_header();
  Bytes out(sizeof header + address_.size());
  std::memcpy(out.data(), &header, sizeof header);
  std::memcpy(out.data() + sizeof header, address_.data(), address_.size());
  return out;
}

void UcxTransport::connect(int peer, const Bytes& card) {
  if (card.size() <= sizeof(CardHeader)) {
    throw Error(ErrorKind::kProtocol,
                "rank " + std::to_string(peer) + " published a malformed ucx card", rank_, peer,
                "ucx connect");
  }
  CardHeader header;
  std::memcpy(&header, card.data(), sizeof header);
  std::lock_guard lock(mu_);
  auto ctx = std::make_unique<EndpointContext>(EndpointContext{this, peer});
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(card.data() + sizeof header);
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &Callbacks::peer_failed;
  params.err_handler.arg = ctx.get();
  // A peer on this machine is reached by UCX's shared memory, which has no peer-failure
  // handling (UCX refuses it for endpoints that ask for it, and would fall back to TCP): this
  // rank watches such a peer's process itself, as the shm transport does.
  const auto pid = static_cast<pid_t>(header.pid);
  const bool same_machine = header.same_process_space(own_card_header());
  if (same_machine) {
    params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    if (pid != ::getpid()) watched_.push_back({peer, pid, shm::open_pidfd(pid)});
  }
  const ucs_status_t status =
      lib_.ucp_ep_create(worker_, &params, &endpoints_[static_cast<std::size_t>(peer)]);
  if (status != UCS_OK) {
    throw Error(ErrorKind::kSystem, ucx_error("ucp_ep_create", status), rank_, peer, "ucx connect");
  }
  endpoint_contexts_.push_back(std::move(ctx));
}

void UcxTransport::exchange_hellos(const std::vector<int>& peers, Clock::time_point deadline,
                                   std::chrono::milliseconds timeout) {
  std::vector<OpPtr> ops;
  for (int peer : peers) {
    ops.push_back(post(peer, true, Tag{}, nullptr, 0, Kind::kHello, 0));
    ops.push_back(post(peer, false, Tag{}, nullptr, 0, Kind::kHello, 0));
  }
  std::unique_lock lock(mu_);
  if (drain_locked(ops, deadline)) {
    for (auto& op : ops) finish_locked(*op);  // throws if a hello failed
    return;
  }
  std::string missing;
  for (auto& op : ops) {
    if (!op->send && !op->done) missing += (missing.empty() ? "" : ", ") + std::to_string(op->peer);
  }
  throw Error(ErrorKind::kTimeout,
              "ucx setup: no hello within " + std::to_string(timeout.count()) +
                  " ms from rank(s) " + (missing.empty() ? "(sends pending)" : missing),
              rank_, Error::kNoPeer, "ucx connect");
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
  if (abort_) {
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
  }
  return op;
}

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
  } else {
    abort_locked(error.what());
  }
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
  auto spin_until = Clock::now() + spin_.duration;
  Clock::duration backoff = 20us;
  for (;;) {
    if (op.done) {
      finish_locked(op);
      return;
    }
    if (abort_) throw_failure_locked(op);
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
}

PeerTraffic UcxTransport::traffic(int peer) const {
  std::lock_guard lock(mu_);
  if (peer < 0 || peer >= world_size_) return {};
  return traffic_[static_cast<std::size_t>(peer)];
}

}  // namespace

std::vector<std::pair<std::string, std::string>> ucx_settings(
    const UcxOptions& ucx,
    const std::function<std::optional<std::string>(const std::string&)>& environment_value) {
  std::vector<std::pair<std::string, std::string>> settings = ucx.config;
  const auto value_of = [&](const std::string& name) -> std::optional<std::string> {
    for (const auto& [n, v] : ucx.config) {
      if (n == name) return v;
    }
    return environment_value(name);
  };
  // Every transport UCX_TLS names is tcp or self, and tcp is one of them.
  bool tcp = false, only_tcp_or_self = true;
  std::stringstream list(value_of("TLS").value_or(""));
  for (std::string name; std::getline(list, name, ',');) {
    tcp = tcp || name == "tcp";
    only_tcp_or_self = only_tcp_or_self && (name == "tcp" || name == "self");
  }
  if (tcp && only_tcp_or_self && !value_of("RNDV_THRESH")) {
    settings.emplace_back("RNDV_THRESH", "inf");
  }
  return settings;
}

std::unique_ptr<Transport> make_ucx_transport(Store& store, const std::string& key_prefix, int rank,
                                              int world_size, const std::vector<int>& group,
                                              const TransportOptions& options,
                                              const UcxOptions& ucx,
                                              std::chrono::milliseconds timeout) {
  check_group(rank, world_size, group, "make_ucx_transport");
  if (world_size > kMaxRanks) {
    throw Error(ErrorKind::kInvalidArgument,
                "the ucx transport takes at most " + std::to_string(kMaxRanks) + " ranks", rank,
                Error::kNoPeer, "make_ucx_transport");
  }
  const auto deadline = Clock::now() + timeout;
  auto t = std::make_unique<UcxTransport>(rank, world_size, group, options, ucx);
  auto key = [&](int r) { return key_prefix + "/ucx/" + std::to_string(r); };
  store.set(key(rank), t->card());
  std::vector<int> peers;
  for (int peer : group) {
    if (peer == rank) continue;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    Bytes card;
    try {
      card = store.get(key(peer), std::max(left, std::chrono::milliseconds(0)));
    } catch (const Error& e) {
      throw Error(
          e.kind(),
          "rank " + std::to_string(peer) + " did not publish its ucx address: " + e.detail(), rank,
          peer, "ucx connect");
    }
    t->connect(peer, card);
    peers.push_back(peer);
  }
  t->choose_spin(ucx.spin_us);
  t->exchange_hellos(peers, deadline, timeout);
  return t;
}

}  // namespace gradsync::transport
