"""Every ```python block of README.md and docs/*.md runs as written, each in a fresh process
(forked from one that imported torch and phalanx once: `support.preloaded`).

A block whose first line is a ``# fragment`` comment is part of a longer program instead: the
comment must name the complete program it comes from — an example under ``examples/`` that a
test of this suite runs (a test file names it), or a test file under ``tests/`` that uses what
the block shows.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.preloaded import Preloaded

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
EXAMPLE = re.compile(r"examples/[\w/.-]+\.py|tests/[\w/.-]*test_[\w.-]+\.py")


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """(first line number, code) of each ```python block of a Markdown file."""
    blocks, current, indent, start = [], None, "", 0
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        fence = FENCE.match(line)
        if current is None and fence and fence.group(2) == "python":
            current, indent, start = [], fence.group(1), number + 1
        elif current is not None and fence and not fence.group(2):
            blocks.append((start, "\n".join(current)))
            current = None
        elif current is not None:
            current.append(line.removeprefix(indent))
    return blocks


def _cases():
    for path in DOCUMENTS:
        for line, code in python_blocks(path):
            kind = "fragment" if code.lstrip().startswith("# fragment") else "runs"
            yield pytest.param(path, line, code, id=f"{path.relative_to(ROOT)}:{line}-{kind}")


CASES = list(_cases())


def _tests_text() -> str:
    return "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py") if p.name != "test_docs.py")


@pytest.fixture(scope="module")
def python():
    with Preloaded() as server:
        yield server


@pytest.mark.parametrize(("path", "line", "code"), CASES)
def test_block_runs_or_is_a_fragment_of_a_tested_example(path, line, code, tmp_path, request):
    where = f"{path.relative_to(ROOT)}, the ```python block starting at line {line}"
    first = code.lstrip().splitlines()[0]
    if first.startswith("# fragment"):
        named = EXAMPLE.findall(first)
        assert named, (
            f"{where}: a '# fragment' comment must name its complete program (examples/....py or "
            "tests/.../test_....py)"
        )
        for example in named:
            assert (ROOT / example).is_file(), f"{where}: {example} does not exist"
            if example.startswith("examples/"):
                assert Path(example).name in _tests_text(), f"{where}: no test runs {example}"
        return
    script = tmp_path / "block.py"
    script.write_text(code + "\n")
    done = request.getfixturevalue("python").run(script, cwd=tmp_path, timeout=300)  # fragments need none
    assert done.returncode == 0, (
        f"{where} failed (exit {done.returncode}). Make it run as written, or start it with "
        f"'# fragment of examples/<file>.py'.\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )


def test_the_extractor_finds_blocks_and_their_lines(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n```python\nx = 1\n```\n\n```bash\nls\n```\n  ```python\n  y = 2\n  ```\n")
    assert python_blocks(page) == [(3, "x = 1"), (10, "y = 2")]
    assert len(CASES) >= 10  # README.md and the guides have blocks: the glob found them
