// Creating, opening and mapping shm transport segments, and process liveness (see
// shm_segment.h).
#include "transport/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <atomic>
#include <cerrno>
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

}  // namespace

std::uint64_t pid_namespace_id() {
  struct stat st;
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<std::uint64_t>(st.st_ino) : 0;
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

void SegmentUnlinker::unlink_all() {
  for (const auto& n : names_) ::shm_unlink(n.c_str());  // ENOENT: another rank was first
  names_.clear();
}

std::string make_segment_name(const std::string& token, const std::string& key_prefix, int rank) {
  static std::atomic<unsigned> counter{0};
  return shm_segment_name(token, key_prefix, ::getpid(), rank, counter++);
}

MappingPtr create_segment(const std::string& name, const Layout& layout, int rank,
                          SegmentUnlinker& unlinker) {
  int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw_setup_errno("cannot create shared memory", name, errno, rank);
  unlinker.add(name);
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
