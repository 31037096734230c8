"""The documentation's links: every relative link and `#anchor` in README.md and docs/*.md must lead
to a file that exists and, for a markdown file, to one of its headings (GitHub's anchor for it),
and every page in docs/ must be reachable from the README."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

from tests.helpers import ROOT

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:.|\n)*?\1")
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
HTML_LINK = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)=\"([^\"]*)\"", re.IGNORECASE)
HTML_ANCHOR = re.compile(r"<a\b[^>]*?\b(?:id|name)=\"([^\"]+)\"", re.IGNORECASE)
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text as rendered (code spans keep their text, links their
    label, HTML tags go), lower-cased, every character but letters, marks, digits, `_`, `-` and
    spaces dropped, spaces as `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).lower()
    kept = "".join(char for char in text if char in "- "
                   or unicodedata.category(char)[0] in "LM" or unicodedata.category(char) in ("Nd", "Nl", "Pc"))
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a markdown file has: one per heading (a repeated one gets -1, -2, … as on
    GitHub) and the explicit `<a id=…>` / `<a name=…>` ones."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
        found.update(HTML_ANCHOR.findall(line))
    return found


def link_targets(path: Path) -> list[str]:
    """The targets of the file's markdown and HTML links, outside code."""
    text = CODE_SPAN.sub("", "\n".join(prose_lines(path.read_text(encoding="utf-8"))))
    return [*INLINE_LINK.findall(text), *REFERENCE_DEFINITION.findall(text), *HTML_LINK.findall(text)]


def documentation_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def link_problems(root: Path) -> list[str]:
    """One line per link that leads nowhere: a missing file, a file outside the repository, or an
    anchor that is not a heading of the markdown file it points into."""
    problems = []
    for source in documentation_files(root):
        name = source.relative_to(root).as_posix()
        for target in link_targets(source):
            if not target or SCHEME.match(target) or target.startswith("//"):
                continue  # a web address: not checked here
            path_part, _, anchor = target.partition("#")
            destination = (source.parent / unquote(path_part)).resolve() if path_part else source
            if not destination.is_relative_to(root.resolve()):
                problems.append(f"{name}: {target}: outside the repository")
            elif not destination.exists():
                problems.append(f"{name}: {target}: no such file")
            elif anchor and destination.suffix == ".md" and unquote(anchor) not in anchors(destination):
                problems.append(f"{name}: {target}: no heading with the anchor #{anchor} in "
                                f"{destination.relative_to(root.resolve()).as_posix()}")
    return problems


def pages_not_linked_from_readme(root: Path) -> list[str]:
    linked = {(root / unquote(target.partition("#")[0])).resolve()
              for target in link_targets(root / "README.md") if not SCHEME.match(target)}
    return [page.relative_to(root).as_posix() for page in sorted((root / "docs").glob("*.md"))
            if page.resolve() not in linked]


def test_every_relative_link_and_anchor_in_the_docs_resolves() -> None:
    assert link_problems(ROOT) == []


def test_every_docs_page_is_linked_from_the_readme() -> None:
    assert pages_not_linked_from_readme(ROOT) == []


def test_broken_links_and_anchors_are_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "code.py").write_text("", encoding="utf-8")
    (tmp_path / "README.md").write_text(
        "# Title\n\n"
        "[ok](docs/page.md) [ok](docs/page.md#the-data-block) [ok](#title) [ok](code.py) [web](https://x.org/y.md)\n"
        "[ok](docs/page.md#data-1) ![ok](docs/page.md) [ok](docs/page.md#explicit)\n"
        "[gone](docs/missing.md) [bad anchor](docs/page.md#nothing) [bad](#titel) [out](../elsewhere.md)\n"
        "`[in code](docs/missing.md)`\n\n"
        "```\n[in a block](docs/missing.md)\n```\n\n"
        "[ref]: docs/also-missing.md\n",
        encoding="utf-8")
    (tmp_path / "docs" / "page.md").write_text(
        "# The `data` block!\n\n## Data\n\n## Data\n\n<a id=\"explicit\"></a>\n\n```\n# not a heading\n```\n\n"
        "[back](../README.md#title) [up](../README.md#not-there)\n",
        encoding="utf-8")
    assert link_problems(tmp_path) == [
        "README.md: docs/missing.md: no such file",
        "README.md: docs/page.md#nothing: no heading with the anchor #nothing in docs/page.md",
        "README.md: #titel: no heading with the anchor #titel in README.md",
        "README.md: ../elsewhere.md: outside the repository",
        "README.md: docs/also-missing.md: no such file",
        "docs/page.md: ../README.md#not-there: no heading with the anchor #not-there in README.md",
    ]
    assert anchors(tmp_path / "docs" / "page.md") == {"the-data-block", "data", "data-1", "explicit"}
    (tmp_path / "docs" / "orphan.md").write_text("# Orphan\n", encoding="utf-8")
    assert pages_not_linked_from_readme(tmp_path) == ["docs/orphan.md"]


def test_anchors_are_githubs() -> None:
    assert slug("Black images and NaN: troubleshooting") == "black-images-and-nan-troubleshooting"
    assert slug("Adapter files: diffusers/peft") == "adapter-files-diffuserspeft"
    assert slug("The original tool's NaN post-mortems") == "the-original-tools-nan-post-mortems"
    assert slug("kohya DoRA: `dora_scale`") == "kohya-dora-dora_scale"
    assert slug("v-prediction markers: `v_pred` and `ztsnr`") == "v-prediction-markers-v_pred-and-ztsnr"
    assert slug("See [the page](x.md) – 1024² images") == "see-the-page--1024-images"


# --- the generated tables (python -m sdxl_trainer.schema_docs) ----------------------------------


def test_each_benchmark_table_is_its_results_file_and_a_changed_one_is_restored() -> None:
    from sdxl_trainer.schema_docs import PERFORMANCE_PAGE, measured_results, page_with_bench_tables, results_table

    page = PERFORMANCE_PAGE.read_text(encoding="utf-8")
    assert measured_results()
    for results in measured_results():
        table = results_table(results.relative_to(ROOT).as_posix())
        assert table.count("\n") >= 2 and f"\n\n{table}\n\n<!-- bench-table:end -->" in page, results.name
    edited = page.replace("| train_sdxl.train(), DoRA rank 4 | 138 |", "| train_sdxl.train(), DoRA rank 4 | 99 |")
    assert edited != page and page_with_bench_tables(edited) == page


def test_a_table_without_its_results_file_or_a_results_file_without_its_table_is_an_error(tmp_path: Path) -> None:
    import pytest

    from sdxl_trainer.schema_docs import DocsError, measured_results, missing_bench_tables, page_with_bench_tables

    start = "<!-- bench-table:start bench/results/{}.md (generated by python -m sdxl_trainer.schema_docs) -->"
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "a.md").write_text("### a\n\n| x |\n|---|\n| 1 |\n\nnotes\n", encoding="utf-8")
    page = f"text\n\n{start.format('a')}\nold\n<!-- bench-table:end -->\n"
    assert page_with_bench_tables(page, tmp_path) == (
        f"text\n\n{start.format('a')}\n\n| x |\n|---|\n| 1 |\n\n<!-- bench-table:end -->\n")
    with pytest.raises(DocsError, match=r"gone\.md does not exist"):
        page_with_bench_tables(f"{start.format('gone')}\n<!-- bench-table:end -->\n", tmp_path)
    with pytest.raises(DocsError, match="has no <!-- bench-table:end -->"):
        page_with_bench_tables(f"{start.format('a')}\n", tmp_path)
    assert missing_bench_tables("no markers") == [
        f"bench/results/{path.name} has no table in docs/performance.md" for path in measured_results()]
    assert {path.name for path in measured_results()} == {
        path.name for path in (ROOT / "bench" / "results").glob("*.md") if not path.name.endswith("_smoke.md")}


def test_the_option_tables_live_on_the_configuration_page() -> None:
    from sdxl_trainer.schema_docs import OPTIONS_PAGE, TABLE_START, options_table

    assert options_table() in OPTIONS_PAGE.read_text(encoding="utf-8")
    assert TABLE_START not in (ROOT / "README.md").read_text(encoding="utf-8")
