// init(): rendezvous through a store, host discovery and the choice of transport per peer.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>

#include "core/context_impl.h"
#include "core/env.h"
#include "rendezvous/socket.h"
#include "rendezvous/store_util.h"
#include "rendezvous/tcp_store.h"
#include "transport/router.h"
#include "transport/shm.h"
#include "transport/tcp.h"
#if GRADSYNC_HAVE_UCX
#include "transport/ucx.h"
#endif

namespace gradsync {

using collectives::CallSignature;
using collectives::CollectiveKind;
using collectives::Comm;

namespace {

// What makes two ranks "the same host" for shared memory: hostname, kernel boot and
// network namespace (namespaces stand in for hosts in the multi-host tests).
std::string host_identity() {
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  char ns[128] = {};
  ssize_t n = ::readlink("/proc/self/ns/net", ns, sizeof ns - 1);
  return std::string(name) + "|" + boot + "|" +
         (n > 0 ? std::string(ns, static_cast<std::size_t>(n)) : "");
}

// Without a token, anyone who can reach the store's port passes its authentication and can
// join the job, read what ranks publish (addresses, host ids) or forge it. Said once per
// process, by the rank that hosts the store.
void warn_without_token(const std::string& where) {
  static std::once_flag once;
  std::call_once(once, [&] {
    std::fprintf(stderr,
                 "gradsync: warning: GRADSYNC_TOKEN is not set, so any process that can reach "
                 "the store at %s can join this job and read or forge its rendezvous data; "
                 "set GRADSYNC_TOKEN to the same secret on every rank (for example `openssl "
                 "rand -hex 16`), or launch with gradsync-run, which sets one\n",
                 where.c_str());
  });
}

// Presents this process as rank 0 to the store already on MASTER_PORT. Where that store is
// this job's and hosted by another rank 0, it fails the job naming both processes, and this
// throws that error; otherwise (another job's store, a wrong token, nothing there) it returns.
void announce_second_rank_zero(const Options& o) {
  std::shared_ptr<Store> other;
  try {
    other = make_tcp_store(o.master_addr, o.master_port, o.token, std::chrono::seconds(2),
                           TcpStoreIdentity{o.rank, o.size});
    other->check("gradsync/second-rank-zero");
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kInvalidArgument) throw;  // the store's verdict on the job
  }
}

}  // namespace

std::unique_ptr<Context> init(const Options& given) {
  Options o = env::resolve(given);
  std::shared_ptr<Store> store = o.store;
  std::unique_ptr<TcpStoreServer> server;
  const auto timeout = o.timeout;
  if (!store && o.size == 1) store = make_inproc_store();
  // Options::socket_ifname (GRADSYNC_SOCKET_IFNAME, like NCCL_SOCKET_IFNAME) pins every
  // socket of this rank, the store rank 0 hosts included, to one interface's address.
  std::string socket_addr;
  if (!o.socket_ifname.empty()) {
    try {
      socket_addr = net::interface_address(o.socket_ifname);
    } catch (const Error& e) {
      const std::string source =
          given.socket_ifname.empty() ? "GRADSYNC_SOCKET_IFNAME" : "Options::socket_ifname";
      throw Error(e.kind(), source + "='" + o.socket_ifname + "': " + e.detail(), o.rank,
                  Error::kNoPeer, "init");
    }
  }
  if (!store) {
    if (o.rank == 0) {
      // The store listens where it is told (GRADSYNC_STORE_BIND), else where its clients dial
      // it: GRADSYNC_SOCKET_IFNAME's address, or MASTER_ADDR when that is an address of this
      // host; every interface only when MASTER_ADDR is not (a name other hosts resolve
      // differently, a forwarded address).
      std::string bind_addr = o.store_bind.empty() ? socket_addr : o.store_bind;
      if (bind_addr.empty()) bind_addr = net::local_listen_address(o.master_addr);
      if (bind_addr.empty()) bind_addr = "0.0.0.0";
      TcpStoreServerOptions server_options;
      server_options.world_size = o.size;
      try {
        server = make_tcp_store_server(bind_addr, o.master_port, o.token, server_options);
      } catch (const Error& e) {
        // The usual cause is not the OS but the launch: two jobs on one MASTER_PORT, or two
        // processes of one job started with RANK=0. In the second case the store there is
        // this job's: announcing this process to it as rank 0 makes it fail every rank,
        // naming both processes (the first would otherwise wait for the whole timeout).
        announce_second_rank_zero(o);
        throw Error(e.kind(),
                    e.detail() + " (does another job use MASTER_PORT " +
                        std::to_string(o.master_port) +
                        ", or was another process of this job started with RANK=0?)",
                    o.rank, Error::kNoPeer, "init");
      }
      if (o.token.empty()) warn_without_token(net::join_host_port(bind_addr, server->port()));
    }
    store = make_tcp_store(o.master_addr, o.master_port, o.token, timeout,
                           TcpStoreIdentity{o.rank, o.size});
  }
  // Several contexts may meet over one store (threads as ranks, torch's subgroups): each
  // rank counts the contexts it made there, in the store itself, so the members of a group
  // agree on the number whatever other groups each process joined before.
  const std::string generation =
      std::to_string(store->add("gradsync/contexts/" + std::to_string(o.rank), 1));
  const std::string prefix = "gradsync/" + generation + "/";

  // Host discovery: ranks with the same identity share memory.
  store->set(prefix + "host/" + std::to_string(o.rank),
             to_bytes(o.host_id.empty() ? host_identity() : o.host_id));
  std::vector<std::string> hosts;
  for (int r = 0; r < o.size; ++r) {
    hosts.push_back(to_string(store->get(prefix + "host/" + std::to_string(r), timeout)));
  }
  std::vector<int> local_group;
  for (int r = 0; r < o.size; ++r) {
    if (hosts[static_cast<std::size_t>(r)] == hosts[static_cast<std::size_t>(o.rank)])
      local_group.push_back(r);
  }
  if (o.local_rank < 0) {
    o.local_rank = static_cast<int>(std::find(local_group.begin(), local_group.end(), o.rank) -
                                    local_group.begin());
  }
  if (o.local_size < 0) o.local_size = static_cast<int>(local_group.size());

  transport::TransportOptions topts;
  topts.format_tag = collectives::describe_tag;
  topts.token = o.token;
  std::vector<std::unique_ptr<transport::Transport>> transports;
  std::vector<int> route(static_cast<std::size_t>(o.size), -1);
  std::vector<std::string> names(static_cast<std::size_t>(o.size), "self");
  const bool all_local = static_cast<int>(local_group.size()) == o.size;
  // ucx carries every peer (UCX's own shared memory within a host); shm+ucx leaves the
  // host's peers to the shm transport, as the default does with tcp.
  const bool use_ucx = o.transport == "ucx" || o.transport == "shm+ucx";
  const bool use_shm = o.transport == "shm" || o.transport == "shm+ucx" ||
                       (o.transport.empty() && local_group.size() > 1);
  if (o.transport == "shm" && !all_local) {
    throw Error(ErrorKind::kInvalidArgument,
                "GRADSYNC_TRANSPORT=shm but not every rank is on this host", o.rank);
  }
  if (o.size > 1) {
    if (use_shm && local_group.size() > 1) {
      transport::ShmOptions shm;
      shm.spin_us = o.shm_spin_us;
      transports.push_back(transport::make_shm_transport(*store, prefix + "shm", o.rank, o.size,
                                                         local_group, topts, timeout, shm));
      for (int r : local_group) {
        if (r != o.rank) {
          route[static_cast<std::size_t>(r)] = 0;
          names[static_cast<std::size_t>(r)] = "shm";
        }
      }
    }
    if (!use_shm || !all_local) {
      // TCP or UCX reaches every rank the shm transport does not (or every rank, if forced).
      std::vector<int> everyone(static_cast<std::size_t>(o.size));
      for (int r = 0; r < o.size; ++r) everyone[static_cast<std::size_t>(r)] = r;
      if (use_ucx) {
#if GRADSYNC_HAVE_UCX
        transports.push_back(transport::make_ucx_transport(*store, prefix + "ucx", o.rank, o.size,
                                                           everyone, topts, {}, timeout));
#else
        throw Error(ErrorKind::kInvalidArgument,
                    "GRADSYNC_TRANSPORT=" + o.transport +
                        ": this build has no ucx transport (cmake -DGRADSYNC_WITH_UCX=ON)",
                    o.rank);
#endif
      }
      transport::TcpOptions tcp;
      if (o.tcp_liveness_s >= 0) tcp.liveness_s = o.tcp_liveness_s;
      if (o.tcp_socket_buffer_bytes >= 0) tcp.socket_buffer_bytes = o.tcp_socket_buffer_bytes;
      tcp.spin_us = o.tcp_spin_us;
      if (!socket_addr.empty()) {
        tcp.bind_addr = tcp.advertise_addr = socket_addr;
      } else if (!o.socket_addr.empty()) {
        tcp.advertise_addr = o.socket_addr;
      } else if (!o.master_addr.empty()) {
        // Peers reach us the way we reach the rendezvous host: through the interface the
        // routing table picks for it (a host name may resolve to an address on another
        // network, or, in network namespaces, to one that does not exist there).
        tcp.advertise_addr = net::local_address_toward(o.master_addr, o.master_port);
      }
      if (!use_ucx) {
        transports.push_back(transport::make_tcp_transport(*store, prefix + "tcp", o.rank, o.size,
                                                           everyone, topts, tcp, timeout));
      }
      const int index = static_cast<int>(transports.size()) - 1;
      for (int r = 0; r < o.size; ++r) {
        if (r != o.rank && route[static_cast<std::size_t>(r)] < 0) {
          route[static_cast<std::size_t>(r)] = index;
          names[static_cast<std::size_t>(r)] = use_ucx ? "ucx" : "tcp";
        }
      }
    }
  }
  auto router =
      std::make_unique<transport::RouterTransport>(o.rank, o.size, std::move(transports), route);
  auto ctx = make_context(std::move(router), o, std::nullopt, hosts);
  detail::ContextAccess::impl(*ctx).peer_transport = names;

  detail::ContextAccess::impl(*ctx).store = store;
  detail::ContextAccess::impl(*ctx).store_server = std::move(server);
  return ctx;
}

}  // namespace gradsync
