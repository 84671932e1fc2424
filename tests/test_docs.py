"""The documentation: docs/reference.md as the parser makes it, what the pages say that the code
and deploy/ must agree with, and no link that leads nowhere."""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

import mooncake_proxy as mp

HERE = Path(__file__).resolve().parents[1]  # the repository's top: this file is in tests/
sys.path.insert(0, str(HERE / "docs"))

import reference  # noqa: E402  (docs/reference.py: docs/ is no package)

PAGES = [HERE / "README.md", *sorted((HERE / "docs").glob("*.md"))]
FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_the_reference_page_is_what_the_parser_says() -> None:
    generated = reference.render(reference.proxy_parser())
    written = reference.PAGE.read_text()
    assert generated == written, "docs/reference.md is stale: run `make reference`"


def test_the_reference_has_a_section_per_argument_group_in_the_parsers_order() -> None:
    parser = argparse.ArgumentParser(prog="p")
    fleet = parser.add_argument_group("fleet", "where the instances are")
    fleet.add_argument("--decode", nargs="+", metavar="URL", help="a decode (default: none)")
    parser.add_argument_group("empty")
    parser.add_argument_group("limits").add_argument("--max-queue", metavar="N", help="a | b")
    page = reference.render(parser)
    headings = re.findall(r"^## (.*)$", page, re.MULTILINE)
    assert headings == ["Options", "Fleet", "Limits"]  # -h, --help; the empty group left out
    assert "where the instances are" in page
    assert "| `--decode URL [URL ...]` | `none` | a decode |" in page
    assert "| `--max-queue N` | — | a \\| b |" in page


def headings(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings."""
    anchors: set[str] = set()
    for title in re.findall(r"^#+ (.*)$", FENCED.sub("", page.read_text()), re.MULTILINE):
        anchor = re.sub(r"[^\w\- ]", "", title.replace("`", "").lower()).replace(" ", "-")
        count = 0
        while (anchor if not count else f"{anchor}-{count}") in anchors:
            count += 1
        anchors.add(anchor if not count else f"{anchor}-{count}")
    return anchors


def test_every_relative_link_points_at_a_file_that_exists() -> None:
    broken = []
    for page in PAGES:
        prose = CODE_SPAN.sub("", FENCED.sub("", page.read_text()))
        for target in LINK.findall(prose):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:: not ours to check offline
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(HERE)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in headings(linked):
                broken.append(f"{page.relative_to(HERE)}: {target} (no such heading)")
    assert not broken, broken


def test_operations_names_exactly_what_a_reload_cannot_change() -> None:
    page = (HERE / "docs" / "operations.md").read_text()
    start = page.index("except those built into the listener")
    listed = set(re.findall(r"`(--[a-z-]+)`", page[start : page.index("A change to one", start)]))
    assert listed == {option.flag for option in mp.SETTINGS if option.restart}


def test_the_unit_and_the_deploy_page_install_it_the_same_way() -> None:
    unit = (HERE / "deploy" / "mooncake-proxy.service").read_text()
    page = (HERE / "docs" / "deploy.md").read_text()
    assert "Documentation=file:///opt/mooncake-proxy/README.md" in unit
    for step in (
        "install -m 644 README.md /opt/mooncake-proxy/README.md",
        "install -m 644 -D -t /opt/mooncake-proxy/docs docs/*.md docs/*.png",
        "install -m 600 deploy/mooncake-proxy.env /etc/mooncake-proxy.env",
        "install -m 644 -D deploy/mooncake-proxy.toml /etc/mooncake-proxy/proxy.toml",
        "install -m 644 deploy/mooncake-proxy.service /etc/systemd/system/",
    ):
        assert step in unit and step in page, step
    assert "cp deploy" not in unit + page


def test_every_function_of_the_module_reads_at_once() -> None:
    """The house's rule (issue 33): no function of the daemon 60 lines long or more."""
    tree = ast.parse((HERE / "mooncake_proxy.py").read_text())
    lengths = {
        f"{node.name} (line {node.lineno})": node.end_lineno - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno
    }
    assert not {name: n for name, n in lengths.items() if n >= 60}
