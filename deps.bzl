"""memlean's external repositories, for memlean's own WORKSPACE and for any workspace that
depends on memlean. Nothing is downloaded.

    # WORKSPACE of a project that uses memlean
    local_repository(name = "memlean", path = "/path/to/memlean")
    load("@memlean//:deps.bzl", "memlean_dependencies")
    memlean_dependencies()
    register_toolchains("@python//:python_toolchain")   # py targets use that interpreter

Declares, unless the workspace already has a repository of that name:
  @rules_cc, @rules_java       shims that forward to Bazel's native rules (Debian's Bazel
                               4.2.3 asks for versions that do not exist offline)
  @platforms                   Debian's bazel-platforms
  @remote_coverage_tools       a stub, so that test targets need no download
  @python, @torch              the configured Python ($MEMLEAN_PYTHON, else python3) and
                               the torch it imports (third_party/torch/torch.bzl)
  @cuda                        the CUDA toolkit, when there is one (third_party/cuda/cuda.bzl)
  @absl                        Debian's absl, linked as pkg-config says (the trainer's flags;
                               third_party/absl/absl.bzl)
The shims are copied out of memlean's own tree, wherever it is, so a consumer needs no path
into memlean besides its local_repository.
"""

load("//third_party/absl:absl.bzl", "local_absl")
load("//third_party/cuda:cuda.bzl", "local_cuda")
load("//third_party/torch:torch.bzl", "local_python", "local_torch")

def _shim_impl(ctx):
    # memlean's root, wherever it is: the folder of its WORKSPACE file.
    root = ctx.path(ctx.attr._memlean_workspace).dirname
    for f in ctx.attr.files:
        ctx.symlink(ctx.path("%s/%s/%s" % (root, ctx.attr.folder, f)), f)

# A repository made of files copied (symlinked) from one of memlean's folders.
_shim = repository_rule(
    implementation = _shim_impl,
    attrs = {
        "folder": attr.string(mandatory = True),
        "files": attr.string_list(mandatory = True),
        "_memlean_workspace": attr.label(default = Label("//:WORKSPACE")),
    },
    local = True,
)

_SHIMS = {
    "rules_cc": ("third_party/rules_cc", ["WORKSPACE", "BUILD", "cc/BUILD", "cc/defs.bzl"]),
    "rules_java": ("third_party/rules_java", ["WORKSPACE", "BUILD", "java/BUILD", "java/defs.bzl"]),
    "remote_coverage_tools": (
        "third_party/coverage_stub",
        ["WORKSPACE", "BUILD", "coverage_report_generator.sh"],
    ),
}

DEBIAN_PLATFORMS = "/usr/share/bazel/tools/platforms"

def memlean_dependencies():
    """Declares every repository memlean needs (see the module docstring)."""
    existing = native.existing_rules()
    for name, (folder, files) in _SHIMS.items():
        if name not in existing:
            _shim(name = name, folder = folder, files = files)
    if "platforms" not in existing:
        native.local_repository(name = "platforms", path = DEBIAN_PLATFORMS)
    if "python" not in existing:
        local_python(name = "python")
    if "torch" not in existing:
        local_torch(name = "torch")
    if "cuda" not in existing:
        local_cuda(name = "cuda")
    if "absl" not in existing:
        local_absl(name = "absl")
