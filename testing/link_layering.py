"""CI check: no memlean library calls into a library that depends on it.

For every cc_library of //ops/... and //runtime/... (and what they reach in //third_party),
each memlean symbol its objects leave undefined must be defined by its own objects or by a
cc_library in its dependency closure. A call "up" (into a dependant, or around a cycle
hidden behind a registration call) links only when the static link order happens to take
the caller's archive first; this finds it from the objects, whatever a binary calls.

    python3 testing/link_layering.py BAZEL [STARTUP_OPTION...]

run after a build of //... (CI runs it after `bazel test //...`). Prints one line per
library checked and exits non-zero on a violation.
"""
import os
import subprocess
import sys


def query(bazel, expr):
    out = subprocess.run(bazel + ["query", expr, "--output=label"], check=True,
                         capture_output=True, text=True).stdout
    return [line for line in out.split() if line.startswith("//")]


def objects_of(bazel, bin_dir, label):
    """The object files of a cc_library's current sources (an output folder may still hold
    objects of sources since renamed or removed: they are not read)."""
    pkg, name = label[2:].split(":")
    stems = set()
    for src in query(bazel, f"labels(srcs, {label})"):
        path = src.split(":", 1)[1]
        if path.endswith((".cc", ".cpp", ".c", ".cu")):
            stems.add(os.path.splitext(os.path.basename(path))[0])
    folder = os.path.join(bin_dir, pkg, "_objs", name)
    found = []
    for root, _, files in os.walk(folder):
        for f in files:
            stem = f[:-len(".pic.o")] if f.endswith(".pic.o") else f[:-len(".o")] if f.endswith(".o") else None
            if stem is not None and stem in stems:
                found.append(os.path.join(root, f))
    # Objects another rule made for it (nvcc's, third_party/cuda:defs.bzl): _<name>_*.o.
    prefix = f"_{name}_"
    pkg_dir = os.path.join(bin_dir, pkg)
    if os.path.isdir(pkg_dir):
        found += [os.path.join(pkg_dir, f) for f in os.listdir(pkg_dir)
                  if f.startswith(prefix) and f.endswith(".o")]
    # A library built both ways has .o and .pic.o of one source: either serves.
    pic = [f for f in found if f.endswith(".pic.o")]
    return pic or found


def memlean_symbols(objects, defined):
    """Mangled memlean symbols the objects define (defined=True) or leave undefined."""
    if not objects:
        return set()
    out = subprocess.run(["nm", "-P", *objects], check=True, capture_output=True,
                         text=True).stdout
    symbols = set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 2 or line.endswith(":"):
            continue  # a file's header line
        name, kind = parts[0], parts[1]
        if "7memlean" not in name:  # the mangled namespace: N7memlean...
            continue
        # U: undefined; w, v: weak undefined. Everything else is a definition.
        if defined == (kind not in ("U", "w", "v")):
            symbols.add(name)
    return symbols


def main(argv):
    bazel = argv[1:] or ["./bazelw"]
    bin_dir = subprocess.run(bazel + ["info", "bazel-bin"], check=True, capture_output=True,
                             text=True).stdout.strip()
    libraries = query(bazel, "kind(cc_library, //ops/... + //runtime/...)")
    objects_cache, defined_cache = {}, {}

    def objects(label):  # a library is read as itself and again in its own closure
        if label not in objects_cache:
            objects_cache[label] = objects_of(bazel, bin_dir, label)
        return objects_cache[label]

    def defined(label):
        if label not in defined_cache:
            defined_cache[label] = memlean_symbols(objects(label), True)
        return defined_cache[label]

    failures = 0
    checked = 0
    for lib in libraries:
        own = objects(lib)
        if not own:
            print(f"link_layering: {lib}: no objects (header-only, or not built here)")
            continue
        closure = query(bazel, f"kind(cc_library, deps({lib})) intersect //...")
        available = set().union(*(defined(dep) for dep in closure))
        missing = sorted(memlean_symbols(own, False) - available)
        checked += 1
        if missing:
            failures += 1
            users = sorted(dep for dep in query(bazel, "kind(cc_library, //...)")
                           if set(missing) & defined(dep))
            print(f"link_layering: {lib} calls {len(missing)} memlean symbol(s) defined outside "
                  f"its dependencies (in {', '.join(users) or 'nothing built'}): "
                  + "; ".join(missing[:5]))
        else:
            print(f"link_layering: {lib}: every memlean symbol it uses is in its dependencies")
    print(f"link_layering: {checked} libraries checked, {failures} calling outside their "
          "dependencies")
    return 1 if failures or checked == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
