"""Writes the ```cpp blocks of README.md and docs/*.md to the given .cc files, one block per
file, in order (README.md first, then the docs pages by path: readme_blocks.in_order).

    extract_cpp.py --markdown README.md docs/bazel.md docs/checkpoint.md ... \
        --out readme_example_1.cc readme_example_2.cc ...

Fails when the files have another number of (unskipped) ```cpp blocks than .cc files named,
so that a block added to or removed from a page needs a matching cc_test in
examples/readme/BUILD. A #line directive points compiler errors at the page's lines.
"""
import argparse
import sys

from examples.readme import readme_blocks


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", nargs="+", required=True,
                        help="README.md and the docs pages, in any order")
    parser.add_argument("--out", nargs="+", required=True,
                        help="the .cc files to write, one per ```cpp block")
    args = parser.parse_args(argv)
    blocks = []
    for path in readme_blocks.in_order(args.markdown):
        with open(path, encoding="utf-8") as f:
            blocks += [b for b in readme_blocks.parse(f.read(), path) if b.language == "cpp"]
    skipped = [b for b in blocks if b.skip_reason]
    if skipped:
        sys.exit(f"extract_cpp: {skipped[0].where()} is marked skip; every C++ example is "
                 f"compiled and run, so remove the marker")
    if len(blocks) != len(args.out):
        sys.exit(
            f"extract_cpp: the markdown files have {len(blocks)} ```cpp blocks "
            f"({', '.join(f'{b.source}:{b.line}' for b in blocks) or 'none'}), but "
            f"{len(args.out)} files were asked for: give examples/readme/BUILD one "
            f"readme_example_N.cc and one cc_test per block, in this order")
    for block, out in zip(blocks, args.out):
        with open(out, "w", encoding="utf-8") as f:
            f.write(f"// Generated from {block.source} line {block.line} by "
                    f"//examples/readme:extract_cpp. Edit {block.source}, not this file.\n")
            f.write(f'#line {block.line + 1} "{block.source}"\n')
            f.write(block.text)


if __name__ == "__main__":
    main()
