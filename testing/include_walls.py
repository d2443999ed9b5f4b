"""CI check: a file includes an `internal/` header only from its own library.

A library's internals live in `<package>/internal/` (its Bazel targets there are private to
the package, so a BUILD that reaches for them fails to build); this checks the sources too,
so that no file, in a package that could see them by a path trick or a copied target, includes
another package's internal header. Run from the repository root:

    python3 testing/include_walls.py

Prints each violation and exits 1 if there is any.
"""
import os
import re
import subprocess
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+/internal/[^"]+)"', re.M)
SOURCES = (".cc", ".h", ".cu", ".cuh", ".cpp")


def owner(path: str) -> str:
    """The library (the folder above internal/, or the file's own folder) a path belongs to:
    ops/swish/internal/checks.h and ops/swish/cpu/x.cc both belong to ops/swish."""
    parts = path.split("/")
    if "internal" in parts:
        return "/".join(parts[:parts.index("internal")])
    # A file in a subfolder of a library (cpu/, cuda/, python/, autograd/) is the library's.
    for depth in range(len(parts) - 1, 0, -1):
        folder = "/".join(parts[:depth])
        if os.path.exists(os.path.join(folder, "BUILD")):
            return folder
    return os.path.dirname(path)


def main() -> int:
    files = subprocess.run(["git", "ls-files"], check=True, capture_output=True,
                           text=True).stdout.split()
    bad = 0
    for path in files:
        if not path.endswith(SOURCES) or not os.path.exists(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for header in INCLUDE.findall(text):
            if owner(header) != owner(path):
                print(f"include_walls: {path} includes {header}, internal to {owner(header)}")
                bad += 1
    print(f"include_walls: {bad} include(s) of another library's internal/ header")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
