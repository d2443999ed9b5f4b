// Test helper: a CPU autocast region in C++, as `with torch.autocast("cpu", dtype=...)` makes
// one (autocast on, its dtype, one nesting level: leaving the outermost region empties
// autocast's cache of weight copies), put back as it was on leaving.
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/ScalarType.h>

namespace memlean::testing {

class AutocastRegion {
 public:
  explicit AutocastRegion(at::ScalarType dtype)
      : enabled_(at::autocast::is_autocast_enabled(at::kCPU)),
        dtype_(at::autocast::get_autocast_dtype(at::kCPU)) {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, dtype);
    at::autocast::increment_nesting();
  }
  ~AutocastRegion() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(at::kCPU, enabled_);
    at::autocast::set_autocast_dtype(at::kCPU, dtype_);
  }
  AutocastRegion(const AutocastRegion&) = delete;
  AutocastRegion& operator=(const AutocastRegion&) = delete;

 private:
  bool enabled_;
  at::ScalarType dtype_;
};

}  // namespace memlean::testing
