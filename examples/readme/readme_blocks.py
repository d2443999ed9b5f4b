"""The fenced code blocks of README.md and docs/*.md, for the tests that run them.

Every block is fenced with a language: python (run by //bindings/python:readme_test), cpp
(compiled and run by the cc_tests in examples/readme/BUILD), text (output; see below), sh
and starlark (commands and Bazel files, not run here). An HTML comment as the last
non-blank line before a fence says how the tests treat the block:

    <!-- readme-test: skip (needs CUDA) -->   do not run this block; the reason is required
    <!-- readme-test: output -->              this text block must appear, verbatim, in the
                                              output of the python block before it
"""
import dataclasses
import re
from typing import List, Optional

LANGUAGES = ("python", "cpp", "text", "sh", "starlark")

_FENCE = re.compile(r"^(\s*)```(.*)$")
_MARKER = re.compile(r"^\s*<!--\s*readme-test:\s*(.*?)\s*-->\s*$")
_SKIP = re.compile(r"^skip\s*\((.+)\)$")


@dataclasses.dataclass
class Block:
    language: str
    line: int  # 1-based line of the opening fence
    text: str  # the lines between the fences
    skip_reason: Optional[str] = None
    is_output: bool = False
    source: str = "README.md"  # the markdown file, as named to parse()

    def where(self, readme: Optional[str] = None) -> str:
        return f"{readme or self.source}:{self.line} (```{self.language} block)"


def in_order(paths: List[str]) -> List[str]:
    """The markdown files in the order their blocks are numbered: README.md first, then the
    others by path (docs/bazel.md, docs/checkpoint.md, ...), however they were listed."""
    return sorted(paths, key=lambda p: (p.rsplit("/", 1)[-1] != "README.md", p))


def parse(text: str, readme: str = "README.md") -> List[Block]:
    """The fenced blocks of `text` (the file `readme`: README.md or a docs page), in order.
    Raises ValueError for an unterminated fence, a fence without a known language, or a
    readme-test marker it does not understand."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, language = fence.group(1), fence.group(2).strip()
        start = i + 1
        if language not in LANGUAGES:
            raise ValueError(
                f"{readme}:{start}: a code fence must name one of the languages "
                f"{', '.join(LANGUAGES)}, got {language!r}")
        end = start
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"{readme}:{start}: the ```{language} block is never closed")
        body = [ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[start:end]]
        block = Block(language, start, "\n".join(body) + "\n", source=readme)
        marker = _marker_before(lines, i)
        if marker is not None:
            skip = _SKIP.match(marker)
            if skip:
                block.skip_reason = skip.group(1).strip()
            elif marker == "output" and language == "text":
                block.is_output = True
            else:
                raise ValueError(
                    f"{readme}:{start}: readme-test marker {marker!r} before a ```{language} "
                    f"block: use 'skip (reason)', or 'output' before a ```text block")
        blocks.append(block)
        i = end + 1
    return blocks


def _marker_before(lines, fence_index):
    j = fence_index - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    if j < 0:
        return None
    m = _MARKER.match(lines[j])
    return m.group(1) if m else None
