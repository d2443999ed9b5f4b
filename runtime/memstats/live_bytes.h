// LiveBytes: exact count of the bytes that tensors allocated on this thread while it is
// alive still hold, and their peak (for the segment planner, tests and the benchmark).
//
// It listens to the allocators' memory reports (c10::MemoryReportingInfoBase, the hook the
// profiler uses): torch's CPU allocator and the CUDA caching allocator report every
// allocation and free to it, byte-exact. The report follows the thread's debug info into
// the autograd engine. It cannot run while the profiler (or another memory reporter) is
// active on this thread: LiveBytes::available() says whether it can.
#pragma once

#include <cstdint>
#include <memory>

namespace memlean {

class LiveBytes {
 public:
  // Starts counting from zero. Throws if !available().
  LiveBytes();
  ~LiveBytes();
  LiveBytes(const LiveBytes&) = delete;
  LiveBytes& operator=(const LiveBytes&) = delete;

  // Whether a LiveBytes can be created on this thread now.
  static bool available();

  // Bytes allocated since construction and not freed yet.
  int64_t live() const;
  // The highest value live() has had since construction or the last reset_peak().
  int64_t peak() const;
  // Sets peak() to live().
  void reset_peak();

 private:
  struct Reporter;
  std::shared_ptr<Reporter> reporter_;
  struct Guard;
  std::unique_ptr<Guard> guard_;
};

}  // namespace memlean
