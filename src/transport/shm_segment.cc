// Creating, opening and mapping shm transport segments, and process liveness (see
// shm_segment.h).
#include "transport/shm_segment.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <utility>

#include "gradsync/shm_segments.h"

namespace gradsync::transport::shm {

namespace {

// Segments this process has mapped, by inode. Ranks that are threads of one process share one
// mapping per segment: less address space and page-table work, and ThreadSanitizer sees both
// sides of every ring at the same address, so it can check the ring protocol.
class MappingRegistry {
 public:
  static MappingRegistry& instance() {
    static auto* registry = new MappingRegistry;  // never destroyed: outlives static transports
    return *registry;
  }
  // The live mapping of the object `st` describes, or a new one made by `map`.
  template <class MapFn>
  MappingPtr find_or_map(const struct stat& st, MapFn map) {
    std::lock_guard lock(mu_);
    std::erase_if(mappings_, [](const auto& entry) { return entry.second.expired(); });
    // An inode cannot be reused while a mapping keeps its object alive, so a live entry is
    // always the same segment.
    auto key = std::make_pair(st.st_dev, st.st_ino);
    if (auto it = mappings_.find(key); it != mappings_.end()) {
      if (auto existing = it->second.lock()) return existing;
    }
    MappingPtr created = map();
    mappings_[key] = created;
    return created;
  }

 private:
  std::mutex mu_;
  std::map<std::pair<dev_t, ino_t>, std::weak_ptr<const Mapping>> mappings_;
};

[[noreturn]] void throw_setup_errno(const std::string& what, const std::string& name, int err,
                                    int rank) {
  throw Error(ErrorKind::kSystem, what + " " + name + ": " + std::strerror(err), rank,
              Error::kNoPeer, "shm transport setup");
}

struct FdCloser {
  int fd;
  ~FdCloser() { ::close(fd); }
};

MappingPtr map_segment(int fd, std::size_t bytes, const std::string& name, int rank) {
  struct stat st;
  if (::fstat(fd, &st) != 0) throw_setup_errno("cannot stat", name, errno, rank);
  return MappingRegistry::instance().find_or_map(st, [&] {
    // MAP_POPULATE pre-faults the page tables so the first transfer does not pay for it.
    void* address =
        ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (address == MAP_FAILED) throw_setup_errno("cannot map", name, errno, rank);
    return std::make_shared<const Mapping>(address, bytes);
  });
}

// The segment names a terminating signal should unlink, as /dev/shm paths. A signal handler
// may neither lock nor allocate, so this is a fixed table of slots, each claimed and released
// with an atomic: free -> writing -> ready -> free.
namespace pending_names {

constexpr std::size_t kSlots = 64;
constexpr std::size_t kPathBytes = 320;  // "/dev/shm" and a name of at most ~200
constexpr int kFree = 0, kWriting = 1, kReady = 2;

struct Slot {
  std::atomic<int> state{kFree};
  char path[kPathBytes];
};
std::array<Slot, kSlots> slots;

// The slot now holding `name`, or -1 (the table full, or the name too long): that segment is
// then left to the sweep of the next job on the host.
int add(const std::string& name) {
  const std::string path = "/dev/shm" + name;
  if (path.size() >= kPathBytes) return -1;
  for (std::size_t i = 0; i < kSlots; ++i) {
    int free = kFree;
    if (!slots[i].state.compare_exchange_strong(free, kWriting)) continue;
    std::memcpy(slots[i].path, path.c_str(), path.size() + 1);
    slots[i].state.store(kReady, std::memory_order_release);
    return static_cast<int>(i);
  }
  return -1;
}

void remove(int slot) {
  if (slot >= 0) slots[static_cast<std::size_t>(slot)].state.store(kFree);
}

// From the signal handler: unlink() is async-signal-safe (shm_unlink is not listed).
void unlink_all_now() {
  for (auto& slot : slots) {
    if (slot.state.load(std::memory_order_acquire) == kReady) ::unlink(slot.path);
  }
}

}  // namespace pending_names

constexpr std::array<int, 3> kTerminatingSignals = {SIGTERM, SIGINT, SIGHUP};
// What each signal did before the handler was installed (written once, before installing).
std::array<struct sigaction, kTerminatingSignals.size()> previous_actions;

void unlink_then_pass_on(int sig, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  pending_names::unlink_all_now();
  std::size_t i = 0;
  while (i + 1 < kTerminatingSignals.size() && kTerminatingSignals[i] != sig) ++i;
  const struct sigaction& previous = previous_actions[i];
  if ((previous.sa_flags & SA_SIGINFO) != 0) {
    if (previous.sa_sigaction) previous.sa_sigaction(sig, info, context);
  } else if (previous.sa_handler == SIG_DFL) {
    // Blocked while this handler runs, the signal is delivered again, to its default action,
    // as soon as it returns.
    struct sigaction default_action {};
    default_action.sa_handler = SIG_DFL;
    ::sigaction(sig, &default_action, nullptr);
    ::raise(sig);
  } else if (previous.sa_handler != SIG_IGN) {
    previous.sa_handler(sig);
  }
  errno = saved_errno;
}

// Once a process: a signal its owner ignores stays ignored.
void install_signal_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (std::size_t i = 0; i < kTerminatingSignals.size(); ++i) {
      struct sigaction current {};
      if (::sigaction(kTerminatingSignals[i], nullptr, &current) != 0) continue;
      if ((current.sa_flags & SA_SIGINFO) == 0 && current.sa_handler == SIG_IGN) continue;
      previous_actions[i] = current;
      struct sigaction ours {};
      ours.sa_sigaction = unlink_then_pass_on;
      ours.sa_flags = SA_SIGINFO | SA_RESTART;
      sigemptyset(&ours.sa_mask);
      ::sigaction(kTerminatingSignals[i], &ours, nullptr);
    }
  });
}

}  // namespace

std::uint64_t pid_namespace_id() {
  return shm_segments_detail::own_pid_namespace();
}

int open_pidfd(pid_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
#else
  (void)pid;
  errno = ENOSYS;
  return -1;
#endif
}

char process_state(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat_line;
  if (!std::getline(in, stat_line)) return 0;
  std::size_t close_paren = stat_line.rfind(')');  // the command name may contain spaces
  if (close_paren == std::string::npos || close_paren + 2 >= stat_line.size()) return '?';
  return stat_line[close_paren + 2];
}

bool process_alive_by_proc(pid_t pid) {
  char state = process_state(pid);
  return state != 0 && state != 'Z' && state != 'X';
}

Mapping::~Mapping() {
  ::munmap(address_, bytes_);
}

void SegmentUnlinker::add(const std::string& name) {
  install_signal_handlers();
  names_.push_back({name, pending_names::add(name)});
}

void SegmentUnlinker::forget_last() {
  if (names_.empty()) return;
  pending_names::remove(names_.back().slot);
  names_.pop_back();
}

void SegmentUnlinker::unlink_all() {
  for (const auto& n : names_) {
    ::shm_unlink(n.name.c_str());  // ENOENT: another rank was first
    pending_names::remove(n.slot);
  }
  names_.clear();
}

std::string make_segment_name(const std::string& token, const std::string& key_prefix, int rank) {
  static std::atomic<unsigned> counter{0};
  return shm_segment_name(token, key_prefix, ::getpid(), rank, counter++);
}

MappingPtr create_segment(const std::string& name, const Layout& layout, int rank,
                          SegmentUnlinker& unlinker) {
  // Registered first: a signal between creating and registering would leave it behind.
  unlinker.add(name);
  int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    const int err = errno;
    unlinker.forget_last();  // not ours (EEXIST) or never made: not ours to unlink
    throw_setup_errno("cannot create shared memory", name, err, rank);
  }
  FdCloser closer{fd};
  if (::ftruncate(fd, static_cast<off_t>(layout.segment_bytes)) != 0) {
    throw_setup_errno("cannot size shared memory", name, errno, rank);
  }
  // Reserve the pages now: a full /dev/shm then fails here with a message instead of killing
  // the process with SIGBUS on first touch in the middle of a transfer.
  if (int err = ::posix_fallocate(fd, 0, static_cast<off_t>(layout.segment_bytes)); err != 0) {
    throw_setup_errno("cannot reserve " + std::to_string(layout.segment_bytes) +
                          " bytes of shared memory (is /dev/shm too small?) for",
                      name, err, rank);
  }
  return map_segment(fd, layout.segment_bytes, name, rank);
}

MappingPtr open_segment(const std::string& name, const Layout& layout, int rank, int owner_rank) {
  int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    throw_setup_errno("cannot open shared memory of rank " + std::to_string(owner_rank), name,
                      errno, rank);
  }
  FdCloser closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) throw_setup_errno("cannot stat", name, errno, rank);
  if (static_cast<std::size_t>(st.st_size) != layout.segment_bytes) {
    throw Error(ErrorKind::kProtocol,
                "segment " + name + " of rank " + std::to_string(owner_rank) + " has " +
                    std::to_string(st.st_size) + " bytes, expected " +
                    std::to_string(layout.segment_bytes) + " (different gradsync builds?)",
                rank, owner_rank, "shm transport setup");
  }
  return map_segment(fd, layout.segment_bytes, name, rank);
}

}  // namespace gradsync::transport::shm
