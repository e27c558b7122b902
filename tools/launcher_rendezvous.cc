// The rendezvous between a job's launchers (launcher_rendezvous.h). One text line per message:
//
//   rendezvous -> launcher   HELLO <nonce>            on connecting
//   launcher -> rendezvous   JOIN <node-rank> <nonce> <proof>
//   rendezvous -> launcher   WELCOME <proof> | REFUSED <why>
//   launcher -> rendezvous   READY <round> | DONE <round> | FAILED <round> <code> <what>
//                            | ABORT <code> <what>
//   rendezvous -> launcher   START <round> <node-index> <nnodes> | STOP <round> <what>
//                            | END <code> <what>
#include "launcher_rendezvous.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <sstream>
#include <vector>

#include "rendezvous/liveness.h"

namespace gradsync_run {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::size_t kMaxLineBytes = 4096;  // a longer line is not one of ours

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "gradsync-run: %s\n", msg.c_str());
  std::exit(1);
}

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

// HMAC-SHA256 keyed by the token over the role, both nonces and the host's index, each on a
// line of its own (none contains a newline), in hex.
std::string prove(const std::string& token, const std::string& role,
                  const std::string& server_nonce, const std::string& client_nonce, int node_rank) {
  const std::string message =
      role + "\n" + server_nonce + "\n" + client_nonce + "\n" + std::to_string(node_rank) + "\n";
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  static const unsigned char kEmptyKey = 0;
  const void* key = token.empty() ? static_cast<const void*>(&kEmptyKey) : token.data();
  if (!HMAC(EVP_sha256(), key, static_cast<int>(token.size()),
            reinterpret_cast<const unsigned char*>(message.data()), message.size(), out, &length)) {
    die("HMAC-SHA256 failed");
  }
  return hex(out, length);
}

bool same(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

void set_nodelay(int fd) {
  int on = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
}

// Whole lines are sent with one non-blocking write: they are small, and a peer whose buffer is
// full has stopped reading, which its liveness will tell.
bool send_line(int fd, const std::string& line) {
  const std::string data = line + "\n";
  return ::send(fd, data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT) ==
         static_cast<ssize_t>(data.size());
}

// Reads what is there into `in`. False at end of stream or on an error (`why` says which).
bool read_available(int fd, std::string& in, std::string& why) {
  char buf[4096];
  const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
  if (n > 0) {
    in.append(buf, static_cast<std::size_t>(n));
    return true;
  }
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return true;
  why = n == 0 ? "connection closed" : std::strerror(errno);
  return false;
}

// The first whole line of `in`, taken out of it.
std::optional<std::string> take_line(std::string& in) {
  const std::size_t nl = in.find('\n');
  if (nl == std::string::npos) return std::nullopt;
  std::string line = in.substr(0, nl);
  in.erase(0, nl + 1);
  return line;
}

// "WORD a b rest of the line" -> the word, then the fields one by one.
struct Fields {
  explicit Fields(const std::string& line) : in(line) { in >> word; }
  bool number(int& out) { return static_cast<bool>(in >> out); }
  std::string rest() {
    std::string s;
    std::getline(in >> std::ws, s);
    return s;
  }
  std::istringstream in;
  std::string word;
};

// --- the rendezvous (host 0) ----------------------------------------------------------------

struct Node {
  int fd = -1;
  std::string addr;
  std::string in;
  std::string nonce;
  int node_rank = -1;  // -1 until its JOIN proved the token
  int ready_round = -1;
  bool done = false;
};

class Rendezvous {
 public:
  Rendezvous(const RendezvousSettings& s, int listen_fd, int wake_fd)
      : s_(s), listen_fd_(listen_fd), wake_fd_(wake_fd) {
    deadline_ = Clock::now() + seconds(s_.join_s);
  }

  // Until the launcher destroys the server: after the end, only reads (and drops) what
  // launchers still send, so that closing never resets a connection before its END is read.
  void serve() {
    for (;;) {
      std::vector<pollfd> fds{{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
      for (const Node& n : nodes_) fds.push_back({n.fd, POLLIN, 0});
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now());
      const int wait_ms = static_cast<int>(std::clamp<long long>(left.count() + 1, 0, 1000));
      if (::poll(fds.data(), fds.size(), gathering_ && !ended_ ? wait_ms : 1000) < 0 &&
          errno != EINTR) {
        die(std::string("rendezvous: poll: ") + std::strerror(errno));
      }
      if (fds[0].revents & POLLIN) accept_one();
      // Nodes may be dropped while serving one of them: walk by descriptor.
      for (std::size_t k = 2; k < fds.size(); ++k) {
        if (fds[k].revents) serve_fd(fds[k].fd);
      }
      // The launcher is going away: after what had arrived (its own ABORT, say).
      if (fds[1].revents) return;
      if (!ended_ && gathering_ && Clock::now() >= deadline_) gathering_timed_out();
    }
  }

 private:
  std::string host_name(const Node& n) const {
    return "host " + std::to_string(n.node_rank) + " (" + n.addr + ")";
  }

  Node* find(int fd) {
    for (Node& n : nodes_) {
      if (n.fd == fd) return &n;
    }
    return nullptr;
  }

  std::vector<Node*> members() {
    std::vector<Node*> out;
    for (Node& n : nodes_) {
      if (n.node_rank >= 0) out.push_back(&n);
    }
    std::sort(out.begin(), out.end(),
              [](const Node* a, const Node* b) { return a->node_rank < b->node_rank; });
    return out;
  }

  void accept_one() {
    sockaddr_in peer{};
    socklen_t len = sizeof peer;
    const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&peer), &len, SOCK_CLOEXEC);
    if (fd < 0) return;
    gradsync::net::set_liveness(fd, s_.liveness_s);
    set_nodelay(fd);
    char addr[INET_ADDRSTRLEN] = "?";
    ::inet_ntop(AF_INET, &peer.sin_addr, addr, sizeof addr);
    Node n;
    n.fd = fd;
    n.addr = addr;
    n.nonce = random_hex(32);
    if (!send_line(fd, "HELLO " + n.nonce)) {
      ::close(fd);
      return;
    }
    nodes_.push_back(std::move(n));
  }

  // Drops a node; a member lost while a round runs stops the round.
  void drop(int fd, const std::string& why) {
    auto it = std::find_if(nodes_.begin(), nodes_.end(), [&](const Node& n) { return n.fd == fd; });
    if (it == nodes_.end()) return;
    const bool member = it->node_rank >= 0;
    const std::string name = host_name(*it);
    ::close(it->fd);
    nodes_.erase(it);
    if (!member || ended_) return;
    lost_ += (lost_.empty() ? "" : ", ") + name;
    std::fprintf(stderr, "gradsync-run: rendezvous: %s lost: %s\n", name.c_str(), why.c_str());
    if (gathering_) {
      check_gathered();
    } else {
      failure(1, name + "'s launcher was lost (" + why + ")");
    }
  }

  void serve_fd(int fd) {
    Node* n = find(fd);
    if (!n) return;
    std::string why;
    if (!read_available(fd, n->in, why)) return drop(fd, why);
    if (ended_) n->in.clear();
    while (!ended_) {
      n = find(fd);
      if (!n) return;
      std::optional<std::string> line = take_line(n->in);
      if (!line) {
        if (n->in.size() > kMaxLineBytes) drop(fd, "sent a line longer than any message");
        return;
      }
      handle(*n, *line);
    }
  }

  void handle(Node& n, const std::string& line) {
    Fields f(line);
    int round = 0, code = 0;
    if (n.node_rank < 0) return join(n, f);
    if (f.word == "READY" && f.number(round)) {
      if (gathering_ && round == round_) {
        n.ready_round = round;
        check_gathered();
      }
    } else if (f.word == "DONE" && f.number(round)) {
      if (!gathering_ && round == round_) {
        n.done = true;
        const auto m = members();
        if (std::all_of(m.begin(), m.end(), [](const Node* x) { return x->done; })) {
          end(0, "every rank of every host finished");
        }
      }
    } else if (f.word == "FAILED" && f.number(round) && f.number(code)) {
      if (!gathering_ && round == round_) failure(code, f.rest() + " on " + host_name(n));
    } else if (f.word == "ABORT" && f.number(code)) {
      end(code, f.rest() + " on " + host_name(n));
    } else {
      drop(n.fd, "sent '" + line.substr(0, 80) + "', which is not a launcher's message");
    }
  }

  void join(Node& n, Fields& f) {
    int node_rank = -1;
    std::string client_nonce, proof;
    const int fd = n.fd;
    if (f.word != "JOIN" || !f.number(node_rank) || !(f.in >> client_nonce >> proof)) {
      return drop(fd, "not a launcher");
    }
    if (!same(proof, prove(s_.token, "launcher", n.nonce, client_nonce, node_rank))) {
      send_line(fd, "REFUSED its GRADSYNC_TOKEN is not this job's");
      std::fprintf(stderr, "gradsync-run: rendezvous: refused a launcher at %s: wrong token\n",
                   n.addr.c_str());
      return drop(fd, "wrong token");
    }
    std::string refusal;
    if (node_rank < 0 || node_rank >= s_.nnodes) {
      refusal = "--node-rank " + std::to_string(node_rank) + " is not below --nnodes " +
                std::to_string(s_.nnodes);
    } else if (std::any_of(nodes_.begin(), nodes_.end(),
                           [&](const Node& x) { return x.node_rank == node_rank; })) {
      refusal = "host " + std::to_string(node_rank) + " has already joined";
    } else if (started_) {
      refusal = "the job has started; a launcher cannot join it later";
    }
    if (!refusal.empty()) {
      send_line(fd, "REFUSED " + refusal);
      return drop(fd, refusal);
    }
    n.node_rank = node_rank;
    send_line(fd, "WELCOME " + prove(s_.token, "rendezvous", n.nonce, client_nonce, node_rank));
  }

  void check_gathered() {
    const auto m = members();
    if (!std::all_of(m.begin(), m.end(), [&](const Node* x) { return x->ready_round == round_; })) {
      return;
    }
    if (round_ == 0 && static_cast<int>(m.size()) < s_.nnodes) return;  // all must come first
    if (static_cast<int>(m.size()) < s_.min_nodes || m.empty()) {
      return end(last_code_, std::to_string(m.size()) + " host(s) left, fewer than " +
                                 (s_.min_nodes < s_.nnodes ? "--min-nodes " : "--nnodes ") +
                                 std::to_string(s_.min_nodes) + " (lost: " + lost_ + ")");
    }
    gathering_ = false;
    started_ = true;
    for (std::size_t i = 0; i < m.size(); ++i) {
      m[i]->done = false;
      send_line(m[i]->fd, "START " + std::to_string(round_) + " " + std::to_string(i) + " " +
                              std::to_string(m.size()));
    }
  }

  void gathering_timed_out() {
    if (round_ == 0) {
      std::string missing;
      for (int k = 0; k < s_.nnodes; ++k) {
        if (std::none_of(nodes_.begin(), nodes_.end(),
                         [&](const Node& x) { return x.node_rank == k; })) {
          missing += (missing.empty() ? "" : ", ") + std::to_string(k);
        }
      }
      return end(1, "host(s) " + missing + " did not join within " +
                        std::to_string(static_cast<int>(s_.join_s)) + " s");
    }
    std::vector<int> late;  // by descriptor: dropping one moves the others
    for (const Node* x : members()) {
      if (x->ready_round != round_) late.push_back(x->fd);
    }
    for (int fd : late) {
      drop(fd, "did not come back within " + std::to_string(static_cast<int>(s_.rejoin_s)) + " s");
      if (ended_) return;
    }
    check_gathered();
  }

  // A rank failed or a host was lost in the running round: stop it everywhere, and either
  // gather the next round or end the job.
  void failure(int code, const std::string& what) {
    last_code_ = code;
    if (restarts_ >= s_.max_restarts) {
      return end(code, what + "; no restarts left (--max-restarts " +
                           std::to_string(s_.max_restarts) + ")");
    }
    ++restarts_;
    gathering_ = true;
    deadline_ = Clock::now() + seconds(s_.rejoin_s);
    for (Node* x : members()) send_line(x->fd, "STOP " + std::to_string(round_) + " " + what);
    ++round_;
  }

  void end(int code, const std::string& what) {
    for (Node* x : members()) {
      send_line(x->fd, "END " + std::to_string(code) + " " + what);
      ::shutdown(x->fd, SHUT_WR);
    }
    ended_ = true;
  }

  RendezvousSettings s_;
  int listen_fd_;
  int wake_fd_;
  std::vector<Node> nodes_;
  int round_ = 0;
  int restarts_ = 0;
  int last_code_ = 1;
  bool gathering_ = true;
  bool started_ = false;
  bool ended_ = false;
  std::string lost_;
  Clock::time_point deadline_;
};

int connect_to(const std::string& addr, int port, int liveness_s, std::string& error) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int rc = ::getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &found)) {
    error = std::string("cannot resolve it: ") + ::gai_strerror(rc);
    return -1;
  }
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) == 0) {
    ::freeaddrinfo(found);
    gradsync::net::set_liveness(fd, liveness_s);
    set_nodelay(fd);
    return fd;
  }
  error = std::strerror(errno);
  ::freeaddrinfo(found);
  if (fd >= 0) ::close(fd);
  return -1;
}

// A whole line from `fd` within `deadline`, or nullopt with `why`.
std::optional<std::string> read_line(int fd, std::string& in, Clock::time_point deadline,
                                     std::string& why) {
  for (;;) {
    if (auto line = take_line(in)) return line;
    if (in.size() > kMaxLineBytes) {
      why = "a line longer than any message";
      return std::nullopt;
    }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      why = "no answer";
      return std::nullopt;
    }
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1000))) < 0 && errno != EINTR) {
      why = std::strerror(errno);
      return std::nullopt;
    }
    if (p.revents && !read_available(fd, in, why)) return std::nullopt;
  }
}

}  // namespace

std::string hex(const unsigned char* data, std::size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (std::size_t k = 0; k < n; ++k) {
    s += digits[data[k] >> 4];
    s += digits[data[k] & 15];
  }
  return s;
}

std::string random_hex(std::size_t bytes) {
  std::vector<unsigned char> random(bytes);
  std::size_t got = 0;
  while (got < bytes) {
    const ssize_t n = ::getrandom(random.data() + got, bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) die(std::string("cannot read random bytes (getrandom): ") + std::strerror(errno));
    got += static_cast<std::size_t>(n);
  }
  return hex(random.data(), bytes);
}

RendezvousServer::RendezvousServer(const RendezvousSettings& settings, int port) {
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int on = 1;
  ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  if (listen_fd_ < 0 || ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(listen_fd_, 64) != 0) {
    die("rendezvous: cannot listen on port " + std::to_string(port) + ": " + std::strerror(errno));
  }
  if (::pipe2(wake_, O_CLOEXEC) != 0) die(std::string("pipe2: ") + std::strerror(errno));
  // OpenSSL sets itself up under locks on first use: done here, before any fork, so that a
  // child forked while the thread signs cannot inherit them held (it execs at once anyway).
  prove(settings.token, "", "", "", 0);
  thread_ = std::thread([settings, this] { Rendezvous(settings, listen_fd_, wake_[0]).serve(); });
}

RendezvousServer::~RendezvousServer() {
  [[maybe_unused]] ssize_t n = ::write(wake_[1], "x", 1);
  thread_.join();
  ::close(listen_fd_);
  ::close(wake_[0]);
  ::close(wake_[1]);
}

RendezvousClient::RendezvousClient(const std::string& addr, int port, int node_rank,
                                   const RendezvousSettings& settings)
    : where_(addr + ":" + std::to_string(port)) {
  const auto deadline = Clock::now() + seconds(settings.join_s);
  std::string error;
  while ((fd_ = connect_to(addr, port, settings.liveness_s, error)) < 0) {
    if (Clock::now() >= deadline) {
      connect_error_ =
          "cannot reach the rendezvous at " + where_ + " (host 0's launcher): " + error;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  std::string why;
  auto hello = read_line(fd_, in_, deadline, why);
  Fields f(hello.value_or(""));
  std::string server_nonce;
  if (!hello || f.word != "HELLO" || !(f.in >> server_nonce)) {
    connect_error_ = "the rendezvous at " + where_ + " did not greet as one (" +
                     (hello ? "'" + hello->substr(0, 80) + "'" : why) + ")";
    return;
  }
  const std::string nonce = random_hex(32);
  send("JOIN " + std::to_string(node_rank) + " " + nonce + " " +
       prove(settings.token, "launcher", server_nonce, nonce, node_rank));
  auto answer = read_line(fd_, in_, deadline, why);
  Fields g(answer.value_or(""));
  std::string proof;
  if (answer && g.word == "REFUSED") {
    connect_error_ = "the rendezvous at " + where_ + " refused this launcher: " + g.rest();
  } else if (!answer || g.word != "WELCOME" || !(g.in >> proof)) {
    connect_error_ = "the rendezvous at " + where_ + " did not answer ('" +
                     answer.value_or(why).substr(0, 80) + "')";
  } else if (!same(proof, prove(settings.token, "rendezvous", server_nonce, nonce, node_rank))) {
    connect_error_ = "the rendezvous at " + where_ + " does not know this job's GRADSYNC_TOKEN";
  }
}

RendezvousClient::~RendezvousClient() {
  if (fd_ >= 0) ::close(fd_);
}

bool RendezvousClient::has_buffered_message() const {
  return in_.find('\n') != std::string::npos;
}

void RendezvousClient::send(const std::string& line) {
  if (fd_ >= 0) send_line(fd_, line);
}

void RendezvousClient::ready(int round) {
  send("READY " + std::to_string(round));
}

void RendezvousClient::failed(int round, int code, const std::string& what) {
  send("FAILED " + std::to_string(round) + " " + std::to_string(code) + " " + what);
}

void RendezvousClient::done(int round) {
  send("DONE " + std::to_string(round));
}

void RendezvousClient::abort(int code, const std::string& what) {
  send("ABORT " + std::to_string(code) + " " + what);
}

Message RendezvousClient::lost(const std::string& why) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  return Message{.kind = Message::Kind::kEnd, .code = 1, .text = why};
}

Message RendezvousClient::next() {
  if (!connect_error_.empty()) return lost(connect_error_);
  if (fd_ < 0) return lost("the rendezvous at " + where_ + " is gone");
  std::string why;
  auto line = read_line(fd_, in_, Clock::time_point::max(), why);
  if (!line) return lost("lost the rendezvous at " + where_ + " (host 0's launcher): " + why);
  Fields f(*line);
  Message m;
  if (f.word == "START" && f.number(m.round) && f.number(m.node_index) && f.number(m.nnodes)) {
    m.kind = Message::Kind::kStart;
  } else if (f.word == "STOP" && f.number(m.round)) {
    m.kind = Message::Kind::kStop;
    m.text = f.rest();
  } else if (f.word == "END" && f.number(m.code)) {
    m.kind = Message::Kind::kEnd;
    m.text = f.rest();
  } else {
    return lost("the rendezvous at " + where_ + " sent '" + line->substr(0, 80) + "'");
  }
  return m;
}

}  // namespace gradsync_run
