"""Writes README.md's ```cpp blocks to the given .cc files, one block per file, in order.

    extract_cpp.py --readme README.md readme_example_1.cc readme_example_2.cc ...

Fails when the README has another number of (unskipped) ```cpp blocks than files named, so
that a block added to or removed from the README needs a matching cc_test in
examples/readme/BUILD. A #line directive points compiler errors at the README's lines.
"""
import argparse
import sys

from examples.readme import readme_blocks


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", required=True, help="path of README.md")
    parser.add_argument("outs", nargs="+", help="the .cc files to write, one per ```cpp block")
    args = parser.parse_args(argv)
    with open(args.readme, encoding="utf-8") as f:
        blocks = [b for b in readme_blocks.parse(f.read()) if b.language == "cpp"]
    skipped = [b for b in blocks if b.skip_reason]
    if skipped:
        sys.exit(f"extract_cpp: {skipped[0].where()} is marked skip; every C++ example is "
                 f"compiled and run, so remove the marker")
    if len(blocks) != len(args.outs):
        sys.exit(
            f"extract_cpp: README.md has {len(blocks)} ```cpp blocks (lines "
            f"{', '.join(str(b.line) for b in blocks) or 'none'}), but {len(args.outs)} files "
            f"were asked for: give examples/readme/BUILD one readme_example_N.cc and one "
            f"cc_test per block")
    for block, out in zip(blocks, args.outs):
        with open(out, "w", encoding="utf-8") as f:
            f.write(f"// Generated from README.md line {block.line} by "
                    f"//examples/readme:extract_cpp. Edit README.md, not this file.\n")
            f.write(f'#line {block.line + 1} "README.md"\n')
            f.write(block.text)


if __name__ == "__main__":
    main()
