#include "transport/ucx_library.h"

#include <dlfcn.h>

#include <atomic>
#include <csignal>
#include <mutex>
#include <string>

#include "core/knobs.h"

namespace gradsync::transport {
namespace {

[[noreturn]] void fail(int rank, const std::string& library, const std::string& what) {
  throw Error(ErrorKind::kSystem,
              "the ucx transport needs UCX (" + library + ", Debian package libucx0): " + what,
              rank, Error::kNoPeer, "ucx setup");
}

UcxLibrary load(int rank) {
  const std::string library = knobs::text("GRADSYNC_UCX_LIBRARY").value_or("libucp.so.0");
  // RTLD_LOCAL: libucs's own signal() and sigaction(), which refuse to replace its handlers,
  // stay out of the process's symbol scope.
  struct sigaction hangup_before {};
  ::sigaction(SIGHUP, nullptr, &hangup_before);
  void* handle = ::dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) fail(rank, library, ::dlerror());
  UcxLibrary table;
  // dlsym through libucp's handle also finds libucs's functions (its dependency).
#define UCX_LIBRARY_LOAD(name)                                                 \
  table.name = reinterpret_cast<decltype(table.name)>(::dlsym(handle, #name)); \
  if (!table.name) fail(rank, library, "no " #name " in it");
  UCX_LIBRARY_FUNCTIONS(UCX_LIBRARY_LOAD)
#undef UCX_LIBRARY_LOAD
  // libucs's constructor took SIGHUP as its "dump debug state" signal (UCX_DEBUG_SIGNO's
  // default): give it back, since gradsync-run forwards SIGHUP to end the ranks.
  struct sigaction hangup_after {};
  ::sigaction(SIGHUP, nullptr, &hangup_after);
  if (hangup_after.sa_handler != hangup_before.sa_handler) {
    table.ucs_debug_disable_signal(SIGHUP);
  }
  return table;
}

}  // namespace

const UcxLibrary& ucx_library(int rank) {
  // Loaded once and never unloaded (UCX keeps threads and handlers for the process's life);
  // after that a call costs one acquire load, not a lock: every completed request's callback
  // comes here. A failed load leaves nothing behind, so the next call tries again. Not a
  // function-local static with a throwing initialiser: ThreadSanitizer's guard (GCC 12's)
  // never wakes a thread that waits on it when the initialiser throws.
  static std::atomic<const UcxLibrary*> loaded{nullptr};
  if (const UcxLibrary* library = loaded.load(std::memory_order_acquire)) return *library;
  static std::mutex loading;
  const std::lock_guard lock(loading);
  if (const UcxLibrary* library = loaded.load(std::memory_order_relaxed)) return *library;
  static UcxLibrary library;
  library = load(rank);
  loaded.store(&library, std::memory_order_release);
  return library;
}

}  // namespace gradsync::transport
