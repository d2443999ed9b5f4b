// Whether this process can run CUDA work, asked one way everywhere (experiments, tests and
// benchmarks choose their device or skip with it).
#pragma once

#include <ATen/Context.h>

namespace memlean {

// torch was built with CUDA, its CUDA library is loaded, and at least one GPU is visible.
inline bool have_cuda_device() { return at::hasCUDA() && at::getNumGPUs() > 0; }

}  // namespace memlean
