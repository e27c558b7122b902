// A timeline of what each rank did and when, in the Chrome trace event format (view it in
// chrome://tracing or ui.perfetto.dev): one row per rank, one track per thread, spans for
// compute, bucket packing, compression and all-reduce, the optimizer. Recording is on when
// GRADSYNC_TIMELINE names the file to write (and costs nothing measurable otherwise).
//
// Example:
//   {
//     gradsync::timeline::Span span("forward", "compute");  // until it goes out of scope
//     forward();
//   }
//   gradsync::timeline::write(*ctx);  // collective: rank 0 writes every rank's events
#pragma once

#include <cstdint>
#include <string>

#include "gradsync/gradsync.h"

namespace gradsync::timeline {

// True when GRADSYNC_TIMELINE is set (read once) or enable() was called.
bool enabled();
// Turns recording on (tests, tools), whatever the environment says.
void enable();
// Microseconds on the host's monotonic clock, which every process of a host shares.
std::int64_t now_us();
// One finished span of this thread.
void record(std::string name, const char* category, std::int64_t start_us, std::int64_t end_us);

// Records the span from construction to destruction (when enabled).
class Span {
 public:
  Span(std::string name, const char* category)
      : on_(enabled()),
        name_(on_ ? std::move(name) : std::string()),
        category_(category),
        start_(on_ ? now_us() : 0) {}
  ~Span() {
    if (on_) record(std::move(name_), category_, start_, now_us());
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  bool on_;
  std::string name_;
  const char* category_;
  std::int64_t start_;
};

// Collective over the context: gathers every rank's recorded spans and rank 0 writes them
// to `path` (default: GRADSYNC_TIMELINE); the recorded spans are then cleared. Returns the
// number of events written (0 on other ranks, or when recording is off).
std::size_t write(Context& ctx, const std::string& path = "");

}  // namespace gradsync::timeline
