// The ucx transport's setup and end (see ucx.h, ucx.cc): UCX's context and worker, the
// progress thread, cards through the store, endpoints, hellos, and the arena's mappings.
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/knobs.h"
#include "transport/shm_segment.h"
#include "transport/ucx_core.h"

namespace gradsync::transport {
namespace ucx {

using namespace std::chrono_literals;

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
      abort_text_(kAbortTextMax),
      peer_rkeys_(static_cast<std::size_t>(world_size)),
      peer_arenas_(static_cast<std::size_t>(world_size)) {
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
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP | UCP_FEATURE_RMA;  // RMA: the arena
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
  // Only a transport for the whole world can offer the arena (SharedArena's members are the
  // world's ranks); whether every peer shares this machine shows in connect().
  if (world_size > 1 && static_cast<int>(group.size()) == world_size) {
    arena_memory_ = std::make_unique<ucx::ArenaMemory>(lib_, context_);
    if (!arena_memory_->ok()) arena_memory_.reset();
  }
  {
    std::lock_guard lock(mu_);
    post_abort_receive_locked();
  }
  stop_fd_ = ::eventfd(0, EFD_CLOEXEC);
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  unpark_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  progress_thread_ = std::thread([this] { progress_loop(); });
}

bool UcxTransport::callers_drive() {
  const std::uint64_t drives = drives_.load(std::memory_order_relaxed);
  const bool driven = waiters_.load(std::memory_order_relaxed) > 0 || drives != drives_seen_;
  drives_seen_ = drives;
  return driven;
}

void UcxTransport::progress_loop() {
  std::unique_lock lock(mu_);
  bool unparked = false;
  while (!stopping_) {
    bool progressed = false;
    while (progress_locked() != 0) progressed = true;
    if (progressed) wake_waiter_locked(false);
    // While callers drive the worker themselves, the thread keeps out of their way: parked,
    // it looks again every kParkLook without the lock, until they have stopped, or a large
    // message is posted (post() unparks it: over TCP a large message moves only while its
    // sender or receiver progresses, and its caller may meanwhile wait on another transport,
    // such as a router's shm side). Armed, it was woken by the very messages they waited for
    // and then queued on mu_ behind them: a wake-up and a hand-over of the lock a message,
    // which made 4 KiB messages between two ranks twice as slow. Looks every millisecond cost
    // as much; every 10 ms, 3% (docs/performance-notes.md).
    if (!unparked && callers_drive()) {
      lock.unlock();
      parked_.store(true, std::memory_order_seq_cst);
      pollfd fds[2] = {{stop_fd_, POLLIN, 0}, {unpark_fd_, POLLIN, 0}};
      while (::poll(fds, 2, kParkLook) == 0 && callers_drive()) {
      }
      parked_.store(false, std::memory_order_relaxed);
      std::uint64_t count = 0;
      unparked = (fds[1].revents & POLLIN) != 0 && ::read(unpark_fd_, &count, sizeof count) > 0;
      lock.lock();
      continue;
    }
    unparked = false;
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
  if (arena_) arena_->close();  // members waiting on this rank's progress stop waiting
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  bump_eventfd(stop_fd_);  // (if it failed, the thread's 100 ms poll ends anyway)
  progress_thread_.join();
  ::close(stop_fd_);
  ::close(wake_fd_);
  ::close(unpark_fd_);
  std::lock_guard lock(mu_);
  // The peers' arena memory is unmapped with their rkeys, which go before the endpoints they
  // were unpacked with.
  arena_.reset();
  peer_arenas_.clear();
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
  arena_memory_.reset();
  lib_.ucp_cleanup(context_);
  for (const auto& w : watched_) {
    if (w.pidfd >= 0) ::close(w.pidfd);
  }
}

// A card: the process (machine, pid namespace, pid), then the UCX worker address and the
// packed rkey of the rank's arena memory (none if it has none).
struct CardHeader {
  char boot_id[40] = {};  // the machine (its boot), as the kernel names it
  std::uint64_t pid_namespace = 0;
  std::uint64_t pid = 0;
  std::uint64_t arena_address = 0;
  std::uint32_t address_bytes = 0;
  std::uint32_t rkey_bytes = 0;
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
  CardHeader header = own_card_header();
  static const std::vector<std::uint8_t> kNoRkey;
  const auto& rkey = arena_memory_ ? arena_memory_->packed_rkey() : kNoRkey;
  header.arena_address = arena_memory_ ? reinterpret_cast<std::uint64_t>(arena_memory_->base()) : 0;
  header.address_bytes = static_cast<std::uint32_t>(address_.size());
  header.rkey_bytes = static_cast<std::uint32_t>(rkey.size());
  Bytes out(sizeof header + address_.size() + rkey.size());
  std::memcpy(out.data(), &header, sizeof header);
  std::memcpy(out.data() + sizeof header, address_.data(), address_.size());
  if (!rkey.empty())
    std::memcpy(out.data() + sizeof header + address_.size(), rkey.data(), rkey.size());
  return out;
}

void UcxTransport::connect(int peer, const Bytes& card) {
  CardHeader header;
  if (card.size() > sizeof header) std::memcpy(&header, card.data(), sizeof header);
  if (card.size() <= sizeof header || header.address_bytes == 0 ||
      card.size() - sizeof header != std::uint64_t{header.address_bytes} + header.rkey_bytes) {
    throw Error(ErrorKind::kProtocol,
                "rank " + std::to_string(peer) + " published a malformed ucx card", rank_, peer,
                "ucx connect");
  }
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
    if (header.rkey_bytes > 0) {
      const auto* rkey = card.data() + sizeof header + header.address_bytes;
      peer_rkeys_[static_cast<std::size_t>(peer)] =
          PeerRkey{{rkey, rkey + header.rkey_bytes}, header.arena_address};
    }
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
  std::vector<std::uint8_t> theirs;
  hello_round(peers, 0, 1, theirs, deadline, timeout);
}

void UcxTransport::set_up_arena(const std::vector<int>& peers, Clock::time_point deadline,
                                std::chrono::milliseconds timeout) {
  std::vector<unsigned char*> mappings(static_cast<std::size_t>(world_size_));
  bool mapped_all = arena_memory_ != nullptr;
  if (mapped_all) mappings[static_cast<std::size_t>(rank_)] = arena_memory_->base();
  {
    std::lock_guard lock(mu_);
    for (int peer : peers) {
      const auto p = static_cast<std::size_t>(peer);
      if (!mapped_all || !peer_rkeys_[p]) {
        mapped_all = false;
        break;
      }
      peer_arenas_[p] = std::make_unique<ucx::PeerArena>(
          lib_, endpoints_[p], peer_rkeys_[p]->packed.data(), peer_rkeys_[p]->address);
      mappings[p] = peer_arenas_[p]->mapped();
      mapped_all = mappings[p] != nullptr;
    }
    peer_rkeys_.clear();
  }
  std::vector<std::uint8_t> theirs;
  hello_round(peers, 1, mapped_all ? 1 : 0, theirs, deadline, timeout);
  if (mapped_all && std::all_of(theirs.begin(), theirs.end(), [](auto b) { return b == 1; })) {
    arena_memory_->zero_region();
    auto arena = std::make_unique<ucx::Arena>(static_cast<ucx::ArenaWaitChecks&>(*this), rank_,
                                              std::move(mappings), spin_.duration, spin_.yield);
    // Under the lock: the progress thread already runs, and an abort from a rank that finished
    // setting up first wakes this arena's waiters (on_abort_message_locked).
    std::lock_guard lock(mu_);
    arena_ = std::move(arena);
    return;
  }
  std::lock_guard lock(mu_);
  peer_arenas_.clear();
  arena_memory_.reset();
}

void UcxTransport::hello_round(const std::vector<int>& peers, std::uint64_t round, std::uint8_t own,
                               std::vector<std::uint8_t>& theirs, Clock::time_point deadline,
                               std::chrono::milliseconds timeout) {
  hello_byte_.assign(1, own);
  theirs.assign(peers.size(), 0);
  std::vector<OpPtr> ops;
  for (std::size_t i = 0; i < peers.size(); ++i) {
    ops.push_back(post(peers[i], true, Tag{}, hello_byte_.data(), 1, Kind::kHello, round));
    ops.push_back(post(peers[i], false, Tag{}, &theirs[i], 1, Kind::kHello, round));
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

}  // namespace ucx

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
  if (world_size > ucx::kMaxRanks) {
    throw Error(ErrorKind::kInvalidArgument,
                "the ucx transport takes at most " + std::to_string(ucx::kMaxRanks) + " ranks",
                rank, Error::kNoPeer, "make_ucx_transport");
  }
  const auto deadline = Clock::now() + timeout;
  auto t = std::make_unique<ucx::UcxTransport>(rank, world_size, group, options, ucx);
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
  t->set_up_arena(peers, deadline, timeout);
  return t;
}

}  // namespace gradsync::transport
