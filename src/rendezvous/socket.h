// Small TCP socket helpers shared by the TCP store and the TCP transport. They live in
// rendezvous/ because that is the lowest layer that opens sockets; transport/ builds on it.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <utility>

namespace gradsync::net {

// Owns a file descriptor; closes it on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// "host:port" with IPv6 hosts in brackets, so it can be parsed back by split_host_port.
std::string join_host_port(const std::string& host, int port);
// Splits "host:port" / "[v6]:port". Throws Error(kInvalidArgument) on a malformed address.
std::pair<std::string, int> split_host_port(const std::string& address);

// A listening socket on bind_addr:port (port 0 = the kernel picks), SO_REUSEADDR set so a
// restarted server can rebind at once. Throws Error(kSystem) naming the address.
Fd listen_tcp(const std::string& bind_addr, int port, bool nonblocking);
int local_port(int fd);

// Connects to host:port, retrying refused/unreachable attempts with exponential backoff
// (a peer may not be listening yet) until `deadline`; then throws Error(kTimeout) naming
// host, port and the last OS error. A host name that does not exist (EAI_NONAME, EAI_FAIL,
// as against EAI_AGAIN: no answer yet) is retried for a few seconds only, then throws
// Error(kInvalidArgument) naming it. Returns a blocking socket with TCP_NODELAY set.
Fd connect_tcp(const std::string& host, int port, std::chrono::steady_clock::time_point deadline,
               const std::string& what);

// The address other hosts can use to reach this one when we listen on a wildcard address:
// the first IPv4 address the host name resolves to, else 127.0.0.1.
std::string default_advertise_address(const std::string& bind_addr);

// The local IPv4 address this host would use to send to host:port (the source address the
// routing table picks; no packet is sent). Where the rendezvous host is reached through one
// interface, that interface's address is the one peers can reach us on too, whatever the
// host name resolves to. Empty if the host does not resolve or no route leads there.
std::string local_address_toward(const std::string& host, int port);

// The address a store serving clients that dial `host` should listen on: `host` itself when
// it is an address of this machine (a numeric one, or "localhost"), or when it is a name that
// resolves here to an address of an interface other than loopback; else empty (listen on
// every interface). A name this host resolves to a loopback address (Debian maps its own
// host name to 127.0.1.1) is not bound: other hosts know that name by another address.
std::string local_listen_address(const std::string& host);

// The IPv4 address of network interface `name` (as Options::socket_ifname names it). Throws
// Error(kInvalidArgument) naming the interface and listing those that have one.
std::string interface_address(const std::string& name);

void set_nonblocking(int fd);
void set_nodelay(int fd);
// Blocks until the whole buffer is written or an error; false on EOF/error (errno set).
bool write_all(int fd, const void* data, std::size_t len);

// Constant-time comparison for job tokens, so a wrong token cannot be refined byte by
// byte from response timing.
bool tokens_equal(const std::string& a, const std::string& b);

}  // namespace gradsync::net
