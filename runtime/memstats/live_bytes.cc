// LiveBytes: a c10::MemoryReportingInfoBase installed for the thread as its profiler
// state, which keeps a table of the live allocations it was told about.
#include "runtime/memstats/live_bytes.h"

#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>

namespace memlean {

struct LiveBytes::Reporter : public c10::MemoryReportingInfoBase {
  mutable std::mutex mutex;
  std::unordered_map<void*, int64_t> sizes;
  int64_t live = 0;
  int64_t peak = 0;

  bool memoryProfilingEnabled() const override { return true; }

  void reportMemoryUsage(void* ptr, int64_t alloc_size, size_t /*total_allocated*/,
                         size_t /*total_reserved*/, c10::Device /*device*/) override {
    std::lock_guard<std::mutex> lock(mutex);
    if (alloc_size > 0) {
      sizes[ptr] = alloc_size;
      live += alloc_size;
      peak = std::max(peak, live);
    } else if (alloc_size < 0) {
      // Frees of memory allocated before this LiveBytes existed are not ours to count.
      auto it = sizes.find(ptr);
      if (it != sizes.end()) {
        live -= it->second;
        sizes.erase(it);
      }
    }
  }
};

struct LiveBytes::Guard {
  explicit Guard(std::shared_ptr<c10::DebugInfoBase> info)
      : guard(c10::DebugInfoKind::PROFILER_STATE, std::move(info)) {}
  c10::DebugInfoGuard guard;
};

bool LiveBytes::available() {
  return c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE) == nullptr;
}

LiveBytes::LiveBytes() : reporter_(std::make_shared<Reporter>()) {
  TORCH_CHECK(available(), "memlean::LiveBytes: the profiler or another memory reporter is "
              "active on this thread; allocations cannot be counted now");
  guard_ = std::make_unique<Guard>(reporter_);
}

LiveBytes::~LiveBytes() = default;

int64_t LiveBytes::live() const {
  std::lock_guard<std::mutex> lock(reporter_->mutex);
  return reporter_->live;
}

int64_t LiveBytes::peak() const {
  std::lock_guard<std::mutex> lock(reporter_->mutex);
  return reporter_->peak;
}

void LiveBytes::reset_peak() {
  std::lock_guard<std::mutex> lock(reporter_->mutex);
  reporter_->peak = reporter_->live;
}

}  // namespace memlean
