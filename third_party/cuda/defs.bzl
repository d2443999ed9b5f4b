"""cuda_library: .cu files compiled by the toolkit's nvcc into a cc_library.

nvcc runs in a genrule per source and writes a position-independent object; the objects
become the srcs of a cc_library, so C++ targets depend on it like on any other library.
Code is generated for sm_80 and sm_90 with PTX for sm_90 (newer GPUs JIT it). Sources must
not include torch headers (keep nvcc fast): pass raw pointers and a cudaStream_t.
"""

load("@cuda//:defs.bzl", "NVCC")

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
        )
        objs.append(obj)
    native.cc_library(
        name = name,
        srcs = objs,
        hdrs = hdrs,
        deps = deps + ["@cuda//:cudart"],
        **kwargs
    )
