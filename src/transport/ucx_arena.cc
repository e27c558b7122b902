// UCX-mapped arena memory and the waits on it; see ucx_arena.h.
#include "transport/ucx_arena.h"

#include <cstring>
#include <new>
#include <string>

#include "transport/shm_group.h"
#include "transport/shm_segment.h"

namespace gradsync::transport::ucx {

ArenaMemory::ArenaMemory(const UcxLibrary& lib, ucp_context_h context)
    : lib_(lib), context_(context) {
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  params.address = nullptr;
  params.length = kArenaBytes;
  // UCX allocates: only memory from its shared-memory allocators can be mapped by peers.
  params.flags = UCP_MEM_MAP_ALLOCATE;
  if (lib_.ucp_mem_map(context_, &params, &memory_) != UCS_OK) {
    memory_ = nullptr;
    return;
  }
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  void* packed = nullptr;
  std::size_t packed_bytes = 0;
  if (lib_.ucp_mem_query(memory_, &attr) != UCS_OK || attr.length < kArenaBytes ||
      lib_.ucp_rkey_pack(context_, memory_, &packed, &packed_bytes) != UCS_OK) {
    lib_.ucp_mem_unmap(context_, memory_);
    memory_ = nullptr;
    return;
  }
  const auto* bytes = static_cast<const std::uint8_t*>(packed);
  packed_rkey_.assign(bytes, bytes + packed_bytes);
  lib_.ucp_rkey_buffer_release(packed);
  base_ = static_cast<unsigned char*>(attr.address);
  // The region is zeroed only once the arena is offered (zero_region): a job whose ranks turn
  // out to span hosts never touches its pages.
  std::memset(base_, 0, kArenaHeaderBytes);
  new (base_) ArenaHeader();
}

void ArenaMemory::zero_region() {
  std::memset(base_ + kArenaHeaderBytes, 0, kArenaBytes - kArenaHeaderBytes);
}

ArenaMemory::~ArenaMemory() {
  if (memory_) lib_.ucp_mem_unmap(context_, memory_);
}

PeerArena::PeerArena(const UcxLibrary& lib, ucp_ep_h endpoint, const std::uint8_t* packed_rkey,
                     std::uint64_t remote_address)
    : lib_(lib) {
  if (lib_.ucp_ep_rkey_unpack(endpoint, packed_rkey, &rkey_) != UCS_OK) {
    rkey_ = nullptr;
    return;
  }
  void* local = nullptr;
  if (lib_.ucp_rkey_ptr(rkey_, remote_address, &local) == UCS_OK) {
    mapped_ = static_cast<unsigned char*>(local);
  }
}

PeerArena::~PeerArena() {
  if (rkey_) lib_.ucp_rkey_destroy(rkey_);
}

Arena::Arena(ArenaWaitChecks& checks, int member, std::vector<unsigned char*> mappings,
             Clock::duration spin, bool yield)
    : checks_(checks),
      member_(member),
      mappings_(std::move(mappings)),
      spin_(spin),
      yield_(yield) {}

std::size_t Arena::checked(int member) const {
  if (member < 0 || member >= members()) {
    throw Error(
        ErrorKind::kInvalidArgument,
        "arena member " + std::to_string(member) + " outside group of " + std::to_string(members()),
        member_, Error::kNoPeer, "ucx arena");
  }
  return static_cast<std::size_t>(member);
}

void Arena::publish(std::uint64_t value) {
  if (value < published_) {
    throw Error(ErrorKind::kInvalidArgument,
                "arena progress may not go back from " + std::to_string(published_) + " to " +
                    std::to_string(value),
                member_, Error::kNoPeer, "ucx arena publish");
  }
  published_ = value;
  // seq_cst, against the sleeping flag a waiter stores before it looks once more (as in the
  // shm transport's shm::wake_if_sleeping): either it sees the value or this sees the flag.
  header(member_).progress.store(value, std::memory_order_seq_cst);
  for (int m = 0; m < members(); ++m) {
    ArenaHeader& other = header(m);
    if (m != member_ && other.owner_sleeping.load(std::memory_order_seq_cst) != 0 &&
        other.sleeping_for_member.load(std::memory_order_relaxed) == member_) {
      shm::ring_doorbell(other.doorbell);
    }
  }
}

void Arena::wake_own() {
  shm::ring_doorbell(header(member_).doorbell);
}

void Arena::close() {
  header(member_).owner_closed.store(1, std::memory_order_seq_cst);
  for (int m = 0; m < members(); ++m) {
    if (m != member_) shm::ring_doorbell(header(m).doorbell);
  }
}

void Arena::wait_for(int member, std::uint64_t value, const Tag& call, Clock::time_point deadline) {
  const auto& counter = header(static_cast<int>(checked(member))).progress;
  if (counter.load(std::memory_order_acquire) >= value) return;
  if (member == member_) {
    throw Error(ErrorKind::kInvalidArgument, "waits for its own arena progress", member_, member_,
                "ucx arena wait");
  }
  ArenaHeader& me = header(member_);
  shm::IdleSpin spin(spin_, yield_);
  auto next_process_check = Clock::now();
  for (;;) {
    if (counter.load(std::memory_order_acquire) >= value) return;
    if (spin.keep_spinning() || !spin.spun_out()) continue;
    // Announce the sleep, look once more (the checks), then sleep unless that ended the wait.
    const std::uint32_t seen = me.doorbell.load(std::memory_order_acquire);
    me.sleeping_for_member.store(member, std::memory_order_relaxed);
    me.owner_sleeping.store(1, std::memory_order_seq_cst);
    struct ClearSleeping {
      shm::FutexWord& flag;
      ~ClearSleeping() { flag.store(0, std::memory_order_relaxed); }
    } clear_sleeping{me.owner_sleeping};
    auto now = Clock::now();
    const bool check_process = now >= next_process_check;
    if (check_process) next_process_check = now + shm::kLivenessInterval;
    if (checks_.arena_wait_over(member, value, call, deadline, check_process)) return;
    now = Clock::now();
    shm::futex_wait(&me.doorbell, seen, std::min(deadline, now + shm::kLivenessInterval) - now);
    spin.restart();
  }
}

}  // namespace gradsync::transport::ucx
