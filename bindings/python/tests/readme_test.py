"""The examples of README.md and of every docs/*.md page run: every ```python block runs, as a
program of its own, in a fresh Python process in an empty folder, and every ```text block
marked `<!-- readme-test: output -->` appears verbatim in what the python block before it (in
the same file) printed. (The ```cpp blocks are compiled and run by //examples/readme.) The
markers are described in examples/readme/readme_blocks.py. Test ids name the file and the
line of the block's opening fence, e.g. `docs/checkpoint.md:line16`."""
import glob
import os
import re
import subprocess
import sys
import tempfile

import pytest

from examples.readme import readme_blocks

# The python blocks of README.md and docs/*.md today, all files together (README.md 4,
# docs/checkpoint.md 2, docs/fit.md 1): the test fails if it finds fewer to run, so it cannot
# pass by finding nothing (raise it when you add an example).
MIN_PYTHON_BLOCKS_RUN = 7
# Blocks that cannot run here (a GPU, several processes) are marked skip with a reason; keep
# them few, all files together (none today).
MAX_SKIPPED = 2
BLOCK_TIMEOUT_S = 120


def _root():
    """The folder holding README.md and docs/: the runfiles under Bazel, else the source tree."""
    candidates = []
    if "TEST_SRCDIR" in os.environ:
        candidates.append(os.path.join(os.environ["TEST_SRCDIR"], "memlean"))
    here = os.path.dirname(os.path.abspath(__file__))
    candidates.append(os.path.normpath(os.path.join(here, "..", "..", "..")))
    for root in candidates:
        if os.path.isfile(os.path.join(root, "README.md")):
            return root
    raise FileNotFoundError(f"README.md not found in any of {candidates}")


ROOT = _root()
# Names relative to ROOT ("README.md", "docs/checkpoint.md"), in the order of
# readme_blocks.in_order, as examples/readme numbers the C++ blocks.
DOCS = [f"docs/{os.path.basename(p)}" for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))]
FILES = readme_blocks.in_order(["README.md"] + DOCS)
BLOCKS = []
for _name in FILES:
    with open(os.path.join(ROOT, _name), encoding="utf-8") as _f:
        BLOCKS += readme_blocks.parse(_f.read(), _name)
PYTHON = [b for b in BLOCKS if b.language == "python"]
RUN = [b for b in PYTHON if not b.skip_reason]


def _id(block):
    return f"{block.source}:line{block.line}"


def _env():
    env = dict(os.environ)
    # The same imports as this test (memlean and its extension from the runfiles), also from
    # the empty folder the block runs in.
    paths = [os.path.abspath(p) for p in sys.path if p]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("MPLBACKEND", "Agg")
    return env


_outputs = {}


def _run(block):
    key = (block.source, block.line)
    if key not in _outputs:
        with tempfile.TemporaryDirectory(prefix="readme_block_") as cwd:
            stem = os.path.splitext(os.path.basename(block.source))[0]
            script = os.path.join(cwd, f"{stem}_line_{block.line}.py")
            with open(script, "w", encoding="utf-8") as f:
                f.write(block.text)
            p = subprocess.run([sys.executable, script], cwd=cwd, env=_env(), capture_output=True,
                               text=True, timeout=BLOCK_TIMEOUT_S)
        _outputs[key] = p
    return _outputs[key]


def test_blocks_are_found_and_skips_are_few_and_explained():
    assert len(RUN) >= MIN_PYTHON_BLOCKS_RUN, (
        f"{ROOT}: found {len(RUN)} python blocks to run in {FILES}, expected at least "
        f"{MIN_PYTHON_BLOCKS_RUN}: {[_id(b) for b in PYTHON]}")
    skipped = [b for b in BLOCKS if b.skip_reason is not None]
    assert len(skipped) <= MAX_SKIPPED, [(b.where(), b.skip_reason) for b in skipped]
    for b in skipped:
        assert b.language == "python", f"{b.where()}: only python blocks can be skipped"
        assert len(b.skip_reason) >= 8, f"{b.where()}: say why it is skipped, got {b.skip_reason!r}"
    assert sum(b.language == "cpp" for b in BLOCKS) >= 2
    assert sum(b.is_output for b in BLOCKS) >= 1


def test_every_docs_page_the_readme_links_to_is_read():
    # The pages come from //docs:markdown (the test's data); one missing there would have its
    # examples silently not run.
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)(?:#[^)]*)?\)", f.read()))
    assert linked, "README.md links to no docs/*.md page"
    assert linked <= set(FILES), f"linked from README.md but not found: {sorted(linked - set(FILES))}"


@pytest.mark.parametrize("block", RUN, ids=[_id(b) for b in RUN])
def test_python_block_runs(block):
    p = _run(block)
    assert p.returncode == 0, (
        f"{block.where()} failed (exit status {p.returncode}):\n{block.text}\n"
        f"--- stderr ---\n{p.stderr}\n--- stdout ---\n{p.stdout}")


OUTPUTS = [b for b in BLOCKS if b.is_output]


@pytest.mark.parametrize("output", OUTPUTS, ids=[_id(b) for b in OUTPUTS])
def test_output_block_is_what_the_python_block_before_it_prints(output):
    before = [b for b in PYTHON if b.source == output.source and b.line < output.line]
    assert before, f"{output.where()}: marked output, but no python block comes before it"
    block = before[-1]
    assert not block.skip_reason, f"{output.where()}: the python block before it is skipped"
    p = _run(block)
    assert p.returncode == 0, f"{block.where()} failed:\n{p.stderr}"
    stdout = "\n".join(line.rstrip() for line in p.stdout.splitlines())
    expected = output.text.rstrip("\n")
    assert expected in stdout, (
        f"{output.where()} is not in the output of {block.where()}:\n--- {output.source} ---\n"
        f"{expected}\n--- printed ---\n{p.stdout}")


def test_parser_rejects_unlabelled_fences_and_unknown_markers():
    with pytest.raises(ValueError, match="must name one of the languages"):
        readme_blocks.parse("text\n```\nls\n```\n")
    with pytest.raises(ValueError, match="never closed"):
        readme_blocks.parse("```python\nx = 1\n")
    with pytest.raises(ValueError, match="readme-test marker"):
        readme_blocks.parse("<!-- readme-test: skipp -->\n```python\nx = 1\n```\n")
    blocks = readme_blocks.parse(
        "a\n<!-- readme-test: skip (needs CUDA) -->\n```python\nx = 1\n```\n\n"
        "<!-- readme-test: output -->\n```text\n1\n```\n")
    assert [(b.language, b.line, b.text, b.skip_reason, b.is_output) for b in blocks] == [
        ("python", 3, "x = 1\n", "needs CUDA", False), ("text", 8, "1\n", None, True)]
    assert readme_blocks.parse("```sh\nls\n```\n", "docs/x.md")[0].where() == "docs/x.md:1 (```sh block)"
    assert readme_blocks.in_order(["docs/b.md", "README.md", "docs/a.md"]) == [
        "README.md", "docs/a.md", "docs/b.md"]


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
