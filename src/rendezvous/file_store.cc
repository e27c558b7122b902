// Store in a shared directory: one file per key, written to a temporary name and renamed
// so readers never see a partial value; add() serialises through flock on a lock file.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <thread>

#include "gradsync/error.h"
#include "gradsync/store.h"
#include "rendezvous/store_util.h"

namespace gradsync {

namespace {

[[noreturn]] void throw_errno(const std::string& what, const std::string& path) {
  throw Error(ErrorKind::kSystem, what + " " + path + ": " + std::strerror(errno),
              Error::kUnknownRank, Error::kNoPeer, "file store");
}

class FileStore final : public Store {
 public:
  explicit FileStore(std::string dir) : dir_(std::move(dir)) {
    if (::mkdir(dir_.c_str(), 0700) != 0 && errno != EEXIST) throw_errno("cannot create", dir_);
  }

  void set(const std::string& key, const Bytes& value) override {
    std::string final_path = path(key);
    std::string tmp = final_path + ".tmp." + std::to_string(::getpid()) + "." +
                      std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id()));
    int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) throw_errno("cannot write", tmp);
    std::size_t done = 0;
    while (done < value.size()) {
      ssize_t n = ::write(fd, value.data() + done, value.size() - done);
      if (n < 0) {
        if (errno == EINTR) continue;
        ::close(fd);
        throw_errno("cannot write", tmp);
      }
      done += static_cast<std::size_t>(n);
    }
    ::close(fd);
    if (::rename(tmp.c_str(), final_path.c_str()) != 0) throw_errno("cannot rename", tmp);
  }

  Bytes get(const std::string& key, std::chrono::milliseconds timeout) override {
    wait({key}, timeout);
    Bytes v;
    if (!read(key, v)) throw_errno("cannot read", path(key));
    return v;
  }

  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    // Poll with a growing sleep: a file system offers no portable change notification.
    auto sleep = std::chrono::microseconds(200);
    for (;;) {
      std::vector<std::string> missing;
      for (const auto& k : keys) {
        if (!check(k)) missing.push_back(k);
      }
      if (missing.empty()) return;
      if (std::chrono::steady_clock::now() >= deadline) {
        throw_store_timeout("file store " + dir_, missing, timeout);
      }
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, std::chrono::microseconds(20000));
    }
  }

  std::int64_t add(const std::string& key, std::int64_t delta) override {
    std::string lock_path = dir_ + "/.lock";
    int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT, 0600);
    if (fd < 0) throw_errno("cannot open", lock_path);
    while (::flock(fd, LOCK_EX) != 0) {
      if (errno != EINTR) {
        ::close(fd);
        throw_errno("cannot lock", lock_path);
      }
    }
    std::int64_t n = 0;
    try {
      Bytes v;
      read(key, v);
      n = decode_int(v) + delta;
      set(key, encode_int(n));
    } catch (...) {
      ::close(fd);  // also releases the lock
      throw;
    }
    ::close(fd);
    return n;
  }

  bool check(const std::string& key) override {
    struct stat st;
    return ::stat(path(key).c_str(), &st) == 0;
  }

 private:
  // Keys may hold '/' and other characters; hex-encode the unsafe ones.
  std::string path(const std::string& key) const {
    std::string name;
    for (unsigned char c : key) {
      if (std::isalnum(c) || c == '_' || c == '-' || c == '.') {
        name += static_cast<char>(c);
      } else {
        char buf[4];
        std::snprintf(buf, sizeof buf, "%%%02x", c);
        name += buf;
      }
    }
    return dir_ + "/k_" + name;
  }
  bool read(const std::string& key, Bytes& out) const {
    std::ifstream in(path(key), std::ios::binary);
    if (!in) return false;
    out.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    return true;
  }
  std::string dir_;
};

}  // namespace

std::shared_ptr<Store> make_file_store(const std::string& directory) {
  return std::make_shared<FileStore>(directory);
}

}  // namespace gradsync
