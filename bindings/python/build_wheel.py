"""Assembles memlean's wheel from files Bazel built (the JAX pattern: a py_binary that
copies built files into a wheel, instead of setup.py).

    build_wheel.py --out W.whl --version V --torch-version T --python-tag cp311 \
        --platform linux_x86_64 memlean/__init__.py=path/to/__init__.py ...
"""
import argparse
import base64
import hashlib
import os
import stat
import sys
import zipfile

# Fixed timestamps make the wheel byte-for-byte reproducible.
_EPOCH = (1980, 1, 1, 0, 0, 0)


def _record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--version", required=True)
    p.add_argument("--torch-version", required=True, help="the torch built against, e.g. 2.14.1+cu130")
    p.add_argument("--python-tag", required=True)
    p.add_argument("--platform", required=True)
    p.add_argument("--readme", help="long description")
    p.add_argument("files", nargs="+", help="DEST=SRC: a path inside the wheel, a built file")
    args = p.parse_args(argv)

    torch_public = args.torch_version.split("+")[0]
    dist_info = f"memlean-{args.version}.dist-info"
    description = open(args.readme, encoding="utf-8").read() if args.readme else ""
    metadata = "\n".join([
        "Metadata-Version: 2.1",
        "Name: memlean",
        f"Version: {args.version}",
        "Summary: Train PyTorch models in less memory, and see exactly where the memory goes.",
        "License: BSD-3-Clause",
        f"Requires-Python: =={sys.version_info[0]}.{sys.version_info[1]}.*",
        f"Requires-Dist: torch=={torch_public}",
        "Description-Content-Type: text/markdown",
        "",
        description,
    ])
    wheel = "\n".join([
        "Wheel-Version: 1.0",
        "Generator: memlean build_wheel.py",
        "Root-Is-Purelib: false",
        f"Tag: {args.python_tag}-{args.python_tag}-{args.platform}",
        "",
    ])

    entries = []
    for spec in args.files:
        dest, sep, src = spec.partition("=")
        if not sep or not dest or not src:
            p.error(f"expected DEST=SRC, got {spec!r}")
        with open(src, "rb") as f:
            entries.append((dest, f.read(), os.access(src, os.X_OK) and dest.endswith(".so")))
    entries.append((f"{dist_info}/METADATA", metadata.encode(), False))
    entries.append((f"{dist_info}/WHEEL", wheel.encode(), False))
    entries.append((f"{dist_info}/top_level.txt", b"memlean\n", False))

    names = [e[0] for e in entries]
    if len(set(names)) != len(names):
        p.error("a path appears twice in the wheel: " + ", ".join(sorted(n for n in names if names.count(n) > 1)))

    record = [f"{name},{_record_hash(data)},{len(data)}" for name, data, _ in entries]
    record.append(f"{dist_info}/RECORD,,")
    entries.append((f"{dist_info}/RECORD", ("\n".join(record) + "\n").encode(), False))

    tmp = args.out + ".tmp"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data, executable in entries:
            info = zipfile.ZipInfo(name, date_time=_EPOCH)
            mode = 0o755 if executable else 0o644
            info.external_attr = (stat.S_IFREG | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
