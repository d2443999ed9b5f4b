// Links all of memlean's public libraries and calls only memlean::swish: a binary that
// depends on a library without calling it must still link (a registration call from a
// library into one that depends on it once left a symbol undefined here, decided by the
// static link order).
#include <ATen/ATen.h>

#include <cstdio>

#include "ops/swish/swish.h"

int main() {
  const at::Tensor y = memlean::swish(at::ones({4}), 1.0);
  std::printf("linked: swish(1) = %.6f\n", y[0].item<double>());
  return 0;
}
