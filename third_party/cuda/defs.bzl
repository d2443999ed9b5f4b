"""CUDA in memlean's BUILD files: if_cuda / if_torch_cuda, and cuda_library.

if_cuda(x, y = []): x where memlean builds its CUDA kernels (the found torch has CUDA, nvcc
exists, and not --config=cpu, i.e. --define=memlean_cuda=off), else y.
if_torch_cuda(x, y = []): x where the found torch has CUDA (libtorch_cuda to link against),
whether or not nvcc exists.
cuda_library: .cu files compiled by the toolkit's nvcc into a cc_library. nvcc runs in a
genrule per source and writes a position-independent object; the objects become the srcs of
a cc_library, so C++ targets depend on it like on any other library. Code is generated for
sm_80 and sm_90 with PTX for sm_90 (newer GPUs JIT it). Sources must not include torch
headers (keep nvcc fast): pass raw pointers and a cudaStream_t.
"""

load("@cuda//:defs.bzl", "HAS_NVCC", "NVCC")
load("@torch//:defs.bzl", "HAS_CUDA")

def if_cuda(if_true, if_false = []):
    if not (HAS_CUDA and HAS_NVCC):
        return if_false
    return select({
        # A label of memlean's own repository, also from a workspace that depends on it.
        str(Label("//third_party/cuda:cuda_off")): if_false,
        "//conditions:default": if_true,
    })

def if_torch_cuda(if_true, if_false = []):
    return if_true if HAS_CUDA else if_false

CUDA_ARCHS = [
    "-gencode arch=compute_80,code=sm_80",
    "-gencode arch=compute_90,code=sm_90",
    "-gencode arch=compute_90,code=compute_90",
]

def _include_roots():
    """-I flags for the root of the repository the calling BUILD file is in, in the source
    tree and among generated files: `.` in memlean's own workspace, `external/memlean` (or
    whatever a consumer named it) in a workspace that depends on memlean."""
    repo = native.repository_name()
    root = "." if repo == "@" else "external/" + repo.lstrip("@")
    gen = "$(GENDIR)" if repo == "@" else "$(GENDIR)/" + root
    return "-I%s -I%s" % (root, gen)

def cuda_library(name, srcs, hdrs = [], deps = [], nvcc_flags = [], **kwargs):
    objs = []
    for src in srcs:
        obj = "_%s_%s.pic.o" % (name, src.replace("/", "_").replace(".cu", ""))
        native.genrule(
            name = obj.replace(".", "_"),
            srcs = [src] + hdrs,
            outs = [obj],
            cmd = " ".join([
                NVCC,
                "-std=c++17 -O3 -Xcompiler -fPIC",
                _include_roots(),
                " ".join(CUDA_ARCHS),
                " ".join(nvcc_flags),
                "-c $(location %s) -o $@" % src,
            ]),
            message = "nvcc " + src,
            tags = kwargs.get("tags", []),  # manual: built only when a target needs it
        )
        objs.append(obj)
    native.cc_library(
        name = name,
        srcs = objs,
        hdrs = hdrs,
        deps = deps + ["@cuda//:cudart"],
        **kwargs
    )
