#!/bin/bash
# fit's checks on a lent GPU machine, in one device call (docs/development.md): builds memlean
# without Bazel (.gpu/build.sh, ../shared/gpu's, patched here as docs/development.md says if it
# is not yet), the C++ and Python CUDA tests of fit and memstats, the timm rows of docs/fit.md
# ("On an H200, 2026-11-29") and where fit's predictions on CUDA part from the measured peaks.
# Each step runs under its own timeout and writes its log into OUT (at most 8 files come back).
#   Here, once: cp -r ../shared/gpu .gpu && mkdir -p .gpu/gtest &&
#               cp -r /usr/src/googletest/googletest/{include,src} .gpu/gtest/ &&
#               echo /.gpu/ >> .git/info/exclude
#   There:      bash tools/gpu_fit_check.sh "$OUT"      (device run with carry [".gpu"])
# About 6 minutes on an H200 (build 33 s with 16 jobs). Never name a shell variable CC here:
# Triton compiles its driver with $CC.
set -u
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0)) s] $*"; }
B=/tmp/b

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, timm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'timm', timm.__version__)"
} > "$OUT/env.txt" 2>&1

# The three changes docs/development.md describes, where the copy lacks them.
if ! grep -q 'ops/\*/python/\*.cc' .gpu/build.sh; then
  sed -i 's|for f in "$SRC"/bindings/python/\*.cc; do add|for f in "$SRC"/bindings/python/*.cc "$SRC"/ops/*/python/*.cc "$SRC"/runtime/*/python/*.cc; do [ -f "$f" ] \&\& add|' .gpu/build.sh
  sed -i "s#! -name '\*_benchmark.cc' | sort)#! -name '*_benchmark.cc' ! -path '*/python/*' ! -path '*/tests/*' ! -path '*/benchmarks/*' | sort)#" .gpu/build.sh
  sed -i 's|CXXFLAGS="-std=c++20 -O2|CXXFLAGS="-fopenmp -std=c++20 -O2|' .gpu/build.sh
fi
{ bash .gpu/build.sh . "$B" 16 &&
  bash tools/gpu_cc_tests.sh . "$B" ops/fit/fit_test.cc \
    "runtime/memstats/memstats_cuda_test.cc:-DMEMLEAN_TEST_WITH_TORCH_CUDA"; } > "$OUT/build.log" 2>&1 ||
  { el "build failed" >> "$OUT/build.log"; exit 1; }
el built >> "$OUT/build.log"
export PYTHONPATH=$B/pkg:$PWD/testing:$PWD/ops/fit/tests

{ timeout 150 "$B/tests/fit_test" --gtest_filter='FitCuda.*:*Cuda'; echo "rc $?"
  timeout 60 "$B/tests/memstats_cuda_test"; echo "rc $?"; el cc; } > "$OUT/cc.log" 2>&1
{ timeout 150 python3 -m pytest -q -s -rfEs -k cuda ops/fit/tests/fit_test.py; echo "rc $?"
  timeout 100 python3 -m pytest -q -rfEs -k cuda ops/swish/tests/swish_variants_test.py \
    ops/swish/tests/layout_test.py runtime/memstats/tests/memstats_test.py; echo "rc $?"
  el py; } > "$OUT/py.log" 2>&1
{ timeout 100 python3 tools/fit_timm_sweep.py --device cuda --models efficientnet_b0,resnet50 \
    --size 224 --batch 128 --runs --channels-last --autocast bf16 --budgets 5 --threads 16
  echo "rc $?"
  for m in ghostnet_100 hrnet_w18_small; do
    timeout 45 python3 tools/fit_prediction_probe.py --model "$m" --size 128 --batch 32 --runs \
      --channels-last --autocast bf16 --device cuda; echo "rc $?"
  done; el fit; } > "$OUT/fit.log" 2>&1
{ timeout 150 python3 -m pytest -q -s -rfEs -k cuda ops/fit/tests/fit_compile_test.py; echo "rc $?"
  el compile; } > "$OUT/compile.log" 2>&1
el end
