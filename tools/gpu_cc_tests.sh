#!/bin/bash
# Builds C++ gtest binaries on a lent GPU machine (no Bazel, no gtest there) against the objects
# of ../shared/gpu/build.sh (BUILD_DIR/obj) and the python3's torch. gtest is compiled from its
# sources, carried in the checkout as .gpu/gtest (cp -r /usr/src/googletest/googletest/{include,src}
# from Debian's libgtest-dev; GTEST_SRC overrides). Each test links every non-Python object.
#   tools/gpu_cc_tests.sh SRC BUILD_DIR test.cc[:extra flags] ...  -> BUILD_DIR/tests/<name>
set -euo pipefail
SRC=$(readlink -f "$1"); BUILD=$(readlink -f "$2"); shift 2
G=${GTEST_SRC:-$SRC/.gpu/gtest}
eval "$(python3 - <<'PY'
import os, torch, shlex, torch.utils.cpp_extension as ce
try: inc = ce.include_paths(device_type="cuda")
except TypeError: inc = ce.include_paths(cuda=True)
print("TORCH_INC=" + shlex.quote(" ".join("-I" + p for p in inc)))
print("TORCH_LIB=" + shlex.quote(os.path.join(os.path.dirname(torch.__file__), "lib")))
print("ABI=%d" % int(torch._C._GLIBCXX_USE_CXX11_ABI))
cudart = sorted({l.split()[-1] for l in open("/proc/self/maps") if "libcudart.so" in l})
print("CUDART=" + shlex.quote(cudart[0] if cudart else ""))
PY
)"
CXX="g++ -std=c++20 -O1 -fopenmp -D_GLIBCXX_USE_CXX11_ABI=$ABI -I$SRC -I$G/include -I$G $TORCH_INC -I/usr/local/cuda/include"
mkdir -p "$BUILD/tests"
pids=()
[ -f "$BUILD/tests/gtest-all.o" ] || { $CXX -c "$G/src/gtest-all.cc" -o "$BUILD/tests/gtest-all.o" & pids+=($!); }
[ -f "$BUILD/tests/gtest_main.o" ] || { $CXX -c "$G/src/gtest_main.cc" -o "$BUILD/tests/gtest_main.o" & pids+=($!); }
for spec in "$@"; do
  t=${spec%%:*}; extra=""; [ "$spec" != "$t" ] && extra=${spec#*:}
  n=$(basename "$t" .cc)
  # shellcheck disable=SC2086
  $CXX $extra -c "$SRC/$t" -o "$BUILD/tests/$n.o" & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
LIBOBJ=$(ls "$BUILD"/obj/*.o | grep -v '/bindings_python_' | grep -v '_python_')
CUDART_DIR=$(dirname "$CUDART")
for spec in "$@"; do
  t=${spec%%:*}; n=$(basename "$t" .cc)
  # shellcheck disable=SC2086
  g++ -fopenmp -o "$BUILD/tests/$n" "$BUILD/tests/$n.o" $LIBOBJ "$BUILD/tests/gtest-all.o" "$BUILD/tests/gtest_main.o" \
    -L"$TORCH_LIB" -Wl,-rpath,"$TORCH_LIB" -Wl,--no-as-needed \
    -lc10 -ltorch -ltorch_cpu -lc10_cuda -ltorch_cuda \
    -L"$CUDART_DIR" -Wl,-rpath,"$CUDART_DIR" -l:"$(basename "$CUDART")" -lpthread
  echo "built $BUILD/tests/$n"
done
