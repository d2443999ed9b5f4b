// The registry between memstats and the CUDA peak observer (cuda_peaks.h). A library of its
// own that both depend on: memstats reads it, cuda_peaks.cc writes it at load time, and
// neither calls into the other, so no static link order can leave a symbol undefined.
#include <c10/util/Exception.h>

#include <optional>

#include "runtime/memstats/internal/cuda_peaks.h"

namespace memlean::memstats::detail {

namespace {
std::optional<CudaPeaks>& registered_cuda_peaks() {
  static std::optional<CudaPeaks> peaks;
  return peaks;
}
}  // namespace

bool register_cuda_peaks(CudaPeaks peaks) {
  registered_cuda_peaks() = peaks;
  return true;
}

const CudaPeaks& cuda_peaks() {
  const auto& peaks = registered_cuda_peaks();
  TORCH_CHECK(peaks.has_value(),
              "memstats: this memlean was built against a torch without CUDA: no CUDA peaks");
  return *peaks;
}

}  // namespace memlean::memstats::detail
