// How the launchers of a job on several hosts restart it together (gradsync-run --nnodes M
// --max-restarts N): host 0's launcher runs a rendezvous that every launcher, its own included,
// keeps one connection to. Each attempt of the job is a round: the rendezvous starts it once
// every launcher still in the job is ready, stops it everywhere when one launcher reports a
// failed rank or is lost (its connection closed, or silent past GRADSYNC_TCP_LIVENESS_S), and
// decides whether another round follows (restarts left, and at least --min-nodes hosts) or
// how the job ends. As torchrun's agents do through their c10d rendezvous; like it, the job
// cannot outlive host 0, where the rendezvous lives.
//
// Connections prove the job token by HMAC-SHA256 challenge-response, as the library's do, so
// the token never crosses the network.
#pragma once

#include <string>
#include <thread>

namespace gradsync_run {

// `n` bytes as lowercase hex digits (tokens, nonces).
std::string hex(const unsigned char* data, std::size_t n);
// `bytes` bytes from the kernel's random source (getrandom), in hex; exits the launcher with a
// message if it cannot read them. The job token and the rendezvous's nonces.
std::string random_hex(std::size_t bytes);

struct RendezvousSettings {
  int nnodes = 1;        // hosts the job starts with; round 0 waits for every one
  int min_nodes = 1;     // fewest hosts a later round may have
  int max_restarts = 0;  // rounds after the first
  int liveness_s = 15;   // GRADSYNC_TCP_LIVENESS_S: a silent launcher is lost after about this
  double rejoin_s = 0;   // how long a later round waits for launchers to come back
  double join_s = 0;     // how long round 0 waits for every host's launcher
  std::string token;
};

// Host 0: serves the launchers on `port` from a thread until it has told them how the job
// ends. Exits the launcher with a message if it cannot listen.
class RendezvousServer {
 public:
  RendezvousServer(const RendezvousSettings& settings, int port);
  ~RendezvousServer();
  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;

 private:
  std::thread thread_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};  // the destructor's "stop now" to a thread still serving
};

// What the rendezvous tells a launcher.
struct Message {
  enum class Kind { kStart, kStop, kEnd };
  Kind kind = Kind::kEnd;
  int round = 0;       // kStart, kStop
  int node_index = 0;  // kStart: this host's index in the round, 0..nnodes-1
  int nnodes = 0;      // kStart: hosts in the round
  int code = 0;        // kEnd: the launcher's exit code
  std::string text;    // kStop, kEnd: what happened
};

class RendezvousClient {
 public:
  // Connects (retrying until `settings.join_s` has passed: host 0's launcher may start later)
  // and proves the token. Failures come back from next() as kEnd.
  RendezvousClient(const std::string& addr, int port, int node_rank,
                   const RendezvousSettings& settings);
  ~RendezvousClient();
  RendezvousClient(const RendezvousClient&) = delete;
  RendezvousClient& operator=(const RendezvousClient&) = delete;

  // Readable when a message (or the end of the connection) has arrived; -1 once closed.
  int fd() const { return fd_; }
  // Whether a whole message has already been read (so poll on fd() would miss it).
  bool has_buffered_message() const;
  void ready(int round);
  void failed(int round, int code, const std::string& what);
  void done(int round);
  void abort(int code, const std::string& what);  // ends the job everywhere, no restart
  // The next message, waiting for it. A lost or refused connection is kEnd, naming why.
  Message next();

 private:
  void send(const std::string& line);
  Message lost(const std::string& why);

  std::string where_;  // "addr:port", for messages
  int fd_ = -1;
  std::string in_;
  std::string connect_error_;  // set when the constructor could not join
};

}  // namespace gradsync_run
