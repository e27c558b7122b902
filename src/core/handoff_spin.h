// Spin briefly, then block: how a thread that hands a call to another (the caller to the
// context's worker, the worker back to a waiter) looks for the other side before it sleeps.
// Each handoff that sleeps costs a futex wake-up and a reschedule (tens of microseconds, far
// more than a small all-reduce), and back-to-back small calls would pay two per call; a spin
// that yields the core at every look costs nothing when the core has nothing else to run,
// and gives it away at once when ranks share cores.
#pragma once

#include <sched.h>

#include <chrono>

namespace gradsync::detail {

// About ten small all-reduces on one host: long enough to catch the other side of a
// back-to-back call, short enough that a thread with nothing to do soon sleeps.
inline constexpr std::chrono::microseconds kHandoffSpin{50};

// Looks at `done` until it is true or the spin is over; true if it became true.
template <class Done>
bool spin_until(Done done) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    if (done()) return true;
    ::sched_yield();
    if (std::chrono::steady_clock::now() - start >= kHandoffSpin) return done();
  }
}

}  // namespace gradsync::detail
