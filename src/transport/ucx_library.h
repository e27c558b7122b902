// UCX, loaded by the first ucx transport of a process rather than linked. Loading libucs
// installs UCX's own handlers for SIGHUP and the fault signals (UCX_DEBUG_SIGNO,
// UCX_ERROR_SIGNALS): a job that never uses UCX keeps its own, and a build with the ucx
// transport runs where UCX is not installed. NCCL loads libibverbs the same way.
#pragma once

#include <ucp/api/ucp.h>
#include <ucs/debug/debug.h>

#include "gradsync/error.h"

namespace gradsync::transport {

// The UCX functions the ucx transport calls, one list for the table and its loader.
#define UCX_LIBRARY_FUNCTIONS(X) \
  X(ucp_cleanup)                 \
  X(ucp_config_modify)           \
  X(ucp_config_read)             \
  X(ucp_config_release)          \
  X(ucp_ep_close_nbx)            \
  X(ucp_ep_create)               \
  X(ucp_ep_rkey_unpack)          \
  X(ucp_init_version)            \
  X(ucp_mem_map)                 \
  X(ucp_mem_query)               \
  X(ucp_mem_unmap)               \
  X(ucp_request_cancel)          \
  X(ucp_request_check_status)    \
  X(ucp_request_free)            \
  X(ucp_rkey_buffer_release)     \
  X(ucp_rkey_destroy)            \
  X(ucp_rkey_pack)               \
  X(ucp_rkey_ptr)                \
  X(ucp_tag_msg_recv_nbx)        \
  X(ucp_tag_probe_nb)            \
  X(ucp_tag_recv_nbx)            \
  X(ucp_tag_send_nbx)            \
  X(ucp_worker_arm)              \
  X(ucp_worker_create)           \
  X(ucp_worker_destroy)          \
  X(ucp_worker_flush_nbx)        \
  X(ucp_worker_get_efd)          \
  X(ucp_worker_progress)         \
  X(ucp_worker_query)            \
  X(ucp_worker_release_address)  \
  X(ucp_worker_signal)           \
  X(ucs_status_string)           \
  X(ucs_debug_disable_signal)

struct UcxLibrary {
#define UCX_LIBRARY_POINTER(name) decltype(&::name) name = nullptr;
  UCX_LIBRARY_FUNCTIONS(UCX_LIBRARY_POINTER)
#undef UCX_LIBRARY_POINTER
};

// Loads libucp.so.0 (and with it libucs) the first time; later calls return the same table.
// SIGHUP keeps the handler it had (gradsync-run forwards it to end the ranks; UCX's debug dump
// can take another signal, UCX_DEBUG_SIGNO=USR2); UCX's fault-signal handlers (a backtrace,
// then the signal's default) stay, as in any UCX program (UCX_HANDLE_ERRORS=none ends them).
// Throws kSystem naming the library and dlopen's reason if UCX is not installed (Debian:
// libucx0) or lacks a function; `rank` only names the caller in that error.
const UcxLibrary& ucx_library(int rank = Error::kUnknownRank);

}  // namespace gradsync::transport
