// Names of the POSIX shared-memory segments the same-host (shm) transport creates, and the
// clean-up a launcher runs once a job's ranks have exited: one definition of the name for both.
//
// Header-only on purpose: gradsync-run links nothing of the library (it must keep reporting
// failed ranks even while the library is broken), yet has to read the names the library
// writes. Linux only, like the transport.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace gradsync {

namespace shm_segments_detail {

// Characters other than [A-Za-z0-9._-] become '_': the name must be one path component.
inline std::string path_safe(std::string_view text) {
  std::string safe;
  for (char c : text) {
    bool keep = std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
    safe += keep ? c : '_';
  }
  return safe;
}

// Where the decimal number that ends text[0, end) starts, provided `tag` stands right before
// it; npos otherwise. Returns the position of `tag`.
inline std::size_t tagged_number_before(std::string_view text, std::size_t end,
                                        std::string_view tag) {
  std::size_t begin = end;
  while (begin > 0 && text[begin - 1] >= '0' && text[begin - 1] <= '9') --begin;
  if (begin == end || begin < tag.size() || text.substr(begin - tag.size(), tag.size()) != tag) {
    return std::string_view::npos;
  }
  return begin - tag.size();
}

}  // namespace shm_segments_detail

// What every segment name of the job with this GRADSYNC_TOKEN starts with, as /dev/shm lists
// it (no leading '/'): "gradsync-<first 8 characters of the token, path-safe>-". Only 8
// characters, so that names stay short and the token does not show in full; jobs whose tokens
// share them tell their segments apart by the creator's pid (remove_stale_shm_segments).
inline std::string shm_segment_prefix(std::string_view token) {
  return "gradsync-" + shm_segments_detail::path_safe(token.substr(0, 8)) + "-";
}

// The name the shm transport gives the segment of `rank` (for shm_open, with the leading '/'):
// "/gradsync-<token[0:8]>-<key_prefix[0:128]>-p<pid>-r<rank>-<serial>", both parts path-safe.
// The key prefix says which context, the pid which process created it (see
// shm_segment_creator), and `serial` keeps several transports of one process apart.
inline std::string shm_segment_name(std::string_view token, std::string_view key_prefix, long pid,
                                    int rank, unsigned serial) {
  return "/" + shm_segment_prefix(token) +
         shm_segments_detail::path_safe(key_prefix.substr(0, 128)) + "-p" + std::to_string(pid) +
         "-r" + std::to_string(rank) + "-" + std::to_string(serial);
}

// The pid of the process that created a segment, read from the end of its name (with or
// without the leading '/'), as shm_segment_name wrote it; nullopt for a name that does not
// end in "-p<pid>-r<rank>-<serial>". Reading from the end keeps a key prefix that itself looks
// like "-p1-r2-3" from being mistaken for the pid.
inline std::optional<pid_t> shm_segment_creator(std::string_view name) {
  using shm_segments_detail::tagged_number_before;
  const std::size_t serial = tagged_number_before(name, name.size(), "-");
  if (serial == std::string_view::npos) return std::nullopt;
  const std::size_t rank = tagged_number_before(name, serial, "-r");
  if (rank == std::string_view::npos) return std::nullopt;
  const std::size_t pid = tagged_number_before(name, rank, "-p");
  if (pid == std::string_view::npos) return std::nullopt;
  const std::string_view digits = name.substr(pid + 2, rank - pid - 2);
  if (digits.size() > 9) return std::nullopt;  // not a pid, and would overflow
  return static_cast<pid_t>(std::stol(std::string(digits)));
}

// Where a segment records the pid namespace its creator ran in (an 8-byte inode number of
// /proc/<pid>/ns/pid, 0 until the creator has written its header): a pid means one process
// only within one namespace. The transport's segment layout keeps it here
// (static_assert in src/transport/shm_layout.h).
inline constexpr std::size_t kShmCreatorNamespaceOffset = 48;

namespace shm_segments_detail {

inline std::uint64_t own_pid_namespace() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<std::uint64_t>(st.st_ino) : 0;
}

// Whether the segment /dev/shm/<name> is one nobody will unlink: its creator (read from the
// name) is gone, it belongs to this user, and it was made in this pid namespace (or its
// creator died before saying where), since a pid from another namespace sharing /dev/shm
// says nothing about that process here. A name that does not say its creator is stale only
// where the caller knows whose it is (`nameless_is_stale`: the launcher, of its own job).
inline bool stale(const std::string& name, std::uint64_t namespace_here, bool nameless_is_stale) {
  const std::optional<pid_t> creator = shm_segment_creator(name);
  if (!creator && !nameless_is_stale) return false;
  if (creator && (*creator <= 0 || ::kill(*creator, 0) == 0 || errno == EPERM)) return false;
  const std::string path = "/dev/shm/" + name;
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0 || st.st_uid != ::geteuid() || !S_ISREG(st.st_mode)) {
    return false;
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return false;
  std::uint64_t made_in = 0;
  const bool read =
      ::pread(fd, &made_in, sizeof made_in, static_cast<off_t>(kShmCreatorNamespaceOffset)) ==
      static_cast<ssize_t>(sizeof made_in);
  ::close(fd);
  return !read || made_in == 0 || made_in == namespace_here;
}

// Unlinks the stale segments whose names start with `prefix`; returns their names.
inline std::vector<std::string> remove_stale_with_prefix(const std::string& prefix,
                                                         bool nameless_is_stale) {
  std::vector<std::string> removed;
  DIR* dir = ::opendir("/dev/shm");
  if (!dir) return removed;
  const std::uint64_t namespace_here = own_pid_namespace();
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0 ||
        !stale(name, namespace_here, nameless_is_stale)) {
      continue;
    }
    if (::unlink(("/dev/shm/" + name).c_str()) == 0) removed.push_back(name);
  }
  ::closedir(dir);
  return removed;
}

}  // namespace shm_segments_detail

// Removes from /dev/shm the segments of the job with this token that no process will unlink:
// the transport unlinks its segments as soon as every rank has mapped them, and when a rank
// ends by SIGTERM, SIGINT or SIGHUP, so only a rank killed (SIGKILL) during setup leaves some
// behind. For a launcher, once all of the job's ranks have exited: those whose names do not
// say their creator go too (this job's, by the token). Keeps a segment whose
// creator still runs (another job whose token shares the first 8 characters, still setting
// up: unlinking would make its ranks fail), one made in another pid namespace, and every
// segment of another user. Does nothing for a token shorter than 8 characters, whose prefix
// unrelated jobs share too easily. Errors are ignored: this is best-effort tidying. Returns
// the names removed.
inline std::vector<std::string> remove_stale_shm_segments(std::string_view token) {
  if (token.size() < 8) return {};
  return shm_segments_detail::remove_stale_with_prefix(shm_segment_prefix(token), true);
}

// The same for every gradsync job's segments, whatever its token, but only those whose names
// say their creator: what each new shm transport runs before it creates its own (so a rank
// killed during setup leaves nothing past the next job on the host), and `gradsync-run
// --cleanup`.
inline std::vector<std::string> remove_stale_shm_segments_of_every_job() {
  return shm_segments_detail::remove_stale_with_prefix("gradsync-", false);
}

}  // namespace gradsync
