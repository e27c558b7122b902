// TCP socket helpers: listen, connect with retry and backoff, address formatting.
#include "rendezvous/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "gradsync/error.h"

namespace gradsync::net {

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void throw_system(const std::string& what) {
  throw Error(ErrorKind::kSystem, what + ": " + std::strerror(errno));
}

struct AddrInfo {
  addrinfo* list = nullptr;
  ~AddrInfo() {
    if (list) ::freeaddrinfo(list);
  }
};

// Resolves host:port; returns the getaddrinfo error text on failure, and sets `permanent`
// when the answer is that the name does not exist (rather than that no answer came).
std::string resolve(const std::string& host, int port, bool passive, AddrInfo& out,
                    bool* permanent = nullptr) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  std::string service = std::to_string(port);
  int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &out.list);
  if (permanent) {
    *permanent = rc == EAI_NONAME || rc == EAI_FAIL;
#ifdef EAI_NODATA
    *permanent = *permanent || rc == EAI_NODATA;
#endif
  }
  if (rc != 0) return rc == EAI_SYSTEM ? std::strerror(errno) : ::gai_strerror(rc);
  return {};
}

// How long a name that does not resolve is tried again before connect_tcp gives up on it:
// long enough for a name that is being registered as the job starts, far less than a job's
// timeout, which a mistyped address would otherwise take.
constexpr auto kUnresolvedGrace = std::chrono::seconds(3);

// One connect attempt bounded by `deadline`; returns the socket or -1 with errno set.
int connect_once(const addrinfo* ai, Clock::time_point deadline) {
  int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
  if (fd < 0) return -1;
  if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) return fd;
  if (errno != EINPROGRESS) {
    int e = errno;
    ::close(fd);
    errno = e;
    return -1;
  }
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      ::close(fd);
      errno = ETIMEDOUT;
      return -1;
    }
    pollfd p{fd, POLLOUT, 0};
    int rc = ::poll(&p, 1, static_cast<int>(std::min<long long>(left.count() + 1, 1000)));
    if (rc < 0 && errno != EINTR) break;
    if (rc > 0) break;
  }
  int err = 0;
  socklen_t len = sizeof err;
  if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
  if (err != 0) {
    ::close(fd);
    errno = err;
    return -1;
  }
  return fd;
}

}  // namespace

void Fd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

std::string join_host_port(const std::string& host, int port) {
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

std::pair<std::string, int> split_host_port(const std::string& address) {
  auto colon = address.rfind(':');
  auto bad = [&] {
    return Error(ErrorKind::kInvalidArgument,
                 "malformed address '" + address + "' (want host:port)");
  };
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) throw bad();
  std::string host = address.substr(0, colon);
  if (host.front() == '[') {
    if (host.back() != ']') throw bad();
    host = host.substr(1, host.size() - 2);
  }
  int port = 0;
  for (char c : address.substr(colon + 1)) {
    if (c < '0' || c > '9' || port > 65535) throw bad();
    port = port * 10 + (c - '0');
  }
  if (port > 65535) throw bad();
  return {host, port};
}

Fd listen_tcp(const std::string& bind_addr, int port, bool nonblocking) {
  AddrInfo ai;
  std::string where = join_host_port(bind_addr, port);
  std::string err = resolve(bind_addr, port, true, ai);
  if (!err.empty())
    throw Error(ErrorKind::kSystem, "cannot resolve listen address " + where + ": " + err);
  int last_errno = 0;
  for (addrinfo* a = ai.list; a; a = a->ai_next) {
    Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | (nonblocking ? SOCK_NONBLOCK : 0),
                   a->ai_protocol));
    if (!fd.valid()) {
      last_errno = errno;
      continue;
    }
    int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    // The backlog is the kernel maximum: every rank of a large job may dial at once, and
    // a refused SYN costs a retry with backoff.
    if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd.get(), SOMAXCONN) == 0) {
      return fd;
    }
    last_errno = errno;
  }
  errno = last_errno;
  throw_system("cannot listen on " + where);
}

int local_port(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) throw_system("getsockname");
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
}

Fd connect_tcp(const std::string& host, int port, Clock::time_point deadline,
               const std::string& what) {
  std::string where = join_host_port(host, port);
  auto backoff = std::chrono::milliseconds(5);
  std::string last_error = "no attempt made";
  int attempts = 0;
  const auto start = Clock::now();
  for (;;) {
    ++attempts;
    AddrInfo ai;
    bool permanent = false;
    std::string err = resolve(host, port, false, ai, &permanent);
    if (permanent && Clock::now() - start >= kUnresolvedGrace) {
      throw Error(ErrorKind::kInvalidArgument, "cannot connect to " + what + " at " + where +
                                                   ": the name " + host + " does not resolve (" +
                                                   err + ")");
    }
    if (err.empty()) {
      for (addrinfo* a = ai.list; a; a = a->ai_next) {
        int fd = connect_once(a, deadline);
        if (fd >= 0) {
          Fd out(fd);
          int flags = ::fcntl(fd, F_GETFL);
          ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
          set_nodelay(fd);
          return out;
        }
        last_error = std::strerror(errno);
      }
    } else {
      last_error = "cannot resolve: " + err;  // DNS may not be ready yet: retry a while
    }
    auto now = Clock::now();
    if (now >= deadline) break;
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
    // An attempt begun with no time left would only report its own timeout in place of
    // what the attempts before it met.
    if (Clock::now() >= deadline) break;
  }
  throw Error(ErrorKind::kTimeout, "cannot connect to " + what + " at " + where + " after " +
                                       std::to_string(attempts) + " attempt(s): " + last_error);
}

std::string default_advertise_address(const std::string& bind_addr) {
  if (!bind_addr.empty() && bind_addr != "0.0.0.0" && bind_addr != "::") return bind_addr;
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) == 0) {
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    AddrInfo ai;
    if (::getaddrinfo(name, nullptr, &hints, &ai.list) == 0 && ai.list) {
      char buf[INET_ADDRSTRLEN] = {};
      auto* sin = reinterpret_cast<sockaddr_in*>(ai.list->ai_addr);
      if (::inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof buf)) return buf;
    }
  }
  return "127.0.0.1";
}

std::string local_address_toward(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  AddrInfo ai;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &ai.list) != 0 ||
      !ai.list) {
    return {};
  }
  // connect() on a UDP socket only looks up the route and fixes the source address.
  Fd fd(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!fd.valid() || ::connect(fd.get(), ai.list->ai_addr, ai.list->ai_addrlen) != 0) return {};
  sockaddr_in local{};
  socklen_t len = sizeof local;
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&local), &len) != 0) return {};
  char buf[INET_ADDRSTRLEN] = {};
  if (!::inet_ntop(AF_INET, &local.sin_addr, buf, sizeof buf)) return {};
  return buf;
}

namespace {

std::string address_text(const sockaddr* sa) {
  char buf[INET6_ADDRSTRLEN] = {};
  const void* addr =
      sa->sa_family == AF_INET
          ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(sa)->sin_addr)
          : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr);
  if (!::inet_ntop(sa->sa_family, addr, buf, sizeof buf)) return {};
  return buf;
}

bool is_loopback(const sockaddr* sa) {
  if (sa->sa_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in*>(sa)->sin_addr.s_addr) >> 24) == 127;
  }
  return IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr);
}

bool is_interface_address(const std::string& text) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return false;
  bool found = false;
  for (ifaddrs* i = list; i && !found; i = i->ifa_next) {
    if (!i->ifa_addr || (i->ifa_addr->sa_family != AF_INET && i->ifa_addr->sa_family != AF_INET6))
      continue;
    found = address_text(i->ifa_addr) == text;
  }
  ::freeifaddrs(list);
  return found;
}

}  // namespace

std::string local_listen_address(const std::string& host) {
  if (host.empty()) return {};
  if (host == "localhost") return "127.0.0.1";
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  AddrInfo ai;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &ai.list) != 0) return {};
  in6_addr v6{};
  in_addr v4{};
  const bool numeric =
      ::inet_pton(AF_INET, host.c_str(), &v4) == 1 || ::inet_pton(AF_INET6, host.c_str(), &v6) == 1;
  for (addrinfo* a = ai.list; a; a = a->ai_next) {
    if (a->ai_family != AF_INET && a->ai_family != AF_INET6) continue;
    const std::string text = address_text(a->ai_addr);
    if (is_loopback(a->ai_addr)) {
      if (numeric) return text;
      continue;
    }
    if (is_interface_address(text)) return text;
  }
  return {};
}

std::string interface_address(const std::string& name) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) throw_system("getifaddrs");
  std::string found, seen;
  for (ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
    char buf[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof buf);
    if (name == i->ifa_name && found.empty()) found = buf;
    seen += std::string(seen.empty() ? "" : ", ") + i->ifa_name + "=" + buf;
  }
  ::freeifaddrs(list);
  if (found.empty()) {
    throw Error(ErrorKind::kInvalidArgument,
                "no interface " + name + " with an IPv4 address (" +
                    (seen.empty() ? std::string("none has one") : "interfaces: " + seen) + ")");
  }
  return found;
}

void set_nonblocking(int fd) {
  int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) throw_system("fcntl O_NONBLOCK");
}

void set_nodelay(int fd) {
  // Small control frames and message headers must not wait for Nagle's 40 ms timer.
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

bool write_all(int fd, const void* data, std::size_t len) {
  const char* p = static_cast<const char*>(data);
  while (len > 0) {
    ssize_t n = ::send(fd, p, len, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += n;
    len -= static_cast<std::size_t>(n);
  }
  return true;
}

bool tokens_equal(const std::string& a, const std::string& b) {
  // Length is not secret (an attacker controls their own token's length); contents are.
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace gradsync::net
