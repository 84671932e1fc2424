"""The daemon module's shape (issue #49): the walk of a streamed chat that docs/flow.md lists
(docs/flow.py makes it), and each chapter banner's "Uses:", which must name exactly the chapters
whose top-level names the chapter's code takes.

``python test_module_shape.py`` prints every chapter's "Uses:" as its code has it.

How a banner's "Uses:" is read: the text after "Uses:" up to its first full stop, across the
banner's lines, its notes in parentheses left out; numbers and ranges ("1-3") separated by
commas; "nothing" is no chapter; "all above" is every chapter above, exactly (it is wrong as soon
as one of them is not used). What a chapter uses: every top-level name of another chapter (a
function, class or assignment, annotated or not, made at the top of the module or under an if,
try or with there; imports are no chapter's) that its code names anywhere: bodies, decorators,
defaults, annotations, and the strings that stand for names (string annotations, ``cast("X",
...)``, ``TypeVar(..., bound="X")``); not a name a function, lambda or comprehension binds for
itself, nor a class's own attribute in its body.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import itertools
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

MODULE = "mooncake_proxy"


def root_of(start: Path) -> Path:
    """The directory that holds the module: this file's, or the nearest one above it."""
    for directory in start.resolve().parents:
        if (directory / f"{MODULE}.py").is_file():
            return directory
    raise RuntimeError(f"no {MODULE}.py in any directory above {start}")


ROOT = root_of(Path(__file__))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
SOURCE = Path(importlib.import_module(MODULE).__file__ or ROOT / f"{MODULE}.py")


# --- A. the walk of a streamed chat (docs/flow.py)


def flow() -> ModuleType:
    """docs/flow.py (docs/ is no package), imported once."""
    if (module := sys.modules.get("docs_flow")) is not None:
        return module
    spec = importlib.util.spec_from_file_location("docs_flow", ROOT / "docs" / "flow.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_flow"] = module  # before it runs: its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


# The fakes take their turns by delays of a tenth of a second (docs/flow.py): on a machine
# loaded enough to stall the loop that long, the legs' events may come in another order. A
# walk that differs is walked again, this many times in all, before the page is called stale.
WALKS = 3


async def test_flow_md_is_the_walk_of_a_streamed_chat() -> None:
    walk = flow()
    written = walk.PAGE.read_text()
    for _ in range(WALKS):
        wanted = walk.page(await walk.walk(), written)
        if wanted == written:
            return
    assert wanted == written, "run make flow\n" + walk.diff(written, wanted)


async def test_the_walk_goes_back_up_the_file_at_most_15_times() -> None:
    walk = flow()
    for _ in range(WALKS):
        stops = await walk.walk()
        if len(up := walk.back_jumps(stops)) <= walk.LIMIT:
            return
    back = [
        f"{stops[i - 1].name} {stops[i - 1].line} -> {stops[i].name} {stops[i].line}" for i in up
    ]
    assert len(up) <= walk.LIMIT, (
        f"{len(up)} of {len(stops)} stops go back up the file:\n" + "\n".join(back)
    )


# --- B. each banner's "Uses:"

RULE = re.compile(r"#\s*={20,}\s*")
TITLE = re.compile(r"#\s*(\d+)\.\s+(.*?)\s*")
USES = re.compile(r"\bUses:", re.IGNORECASE)
# Calls whose string arguments stand for names: how many leading arguments do (None: all but
# the first, TypeVar's own name; its bound= too).
NAMING_CALLS = {"cast": 1, "TypeVar": None}


@dataclass
class Chapter:
    number: int
    title: str
    first: int  # the banner's first line
    last: int  # the line before the next banner's, or the file's last
    banner: str  # the banner's words, after its title
    listed: set[int] | None = None  # None: its Uses could not be read (``error`` says why)
    says: str = ""  # its Uses as written, notes left out
    error: str = ""
    defines: set[str] = field(default_factory=set)
    # chapter number -> the names of it this chapter takes
    takes: dict[int, set[str]] = field(default_factory=dict)

    @property
    def used(self) -> set[int]:
        return set(self.takes)

    @property
    def right(self) -> bool:
        return self.listed == self.used


def banners(lines: Sequence[str]) -> Iterator[Chapter]:
    """Each banner (a rule, "# N. Title", comment lines, a rule) as a chapter that has yet
    to learn where it ends."""
    for index, line in enumerate(lines[:-1]):
        title = TITLE.fullmatch(lines[index + 1])
        if not RULE.fullmatch(line) or title is None:
            continue
        end = next(
            (i for i in range(index + 2, len(lines)) if RULE.fullmatch(lines[i])), len(lines)
        )
        words = " ".join(text.lstrip("#").strip() for text in lines[index + 2 : end])
        yield Chapter(int(title[1]), title[2], index + 1, len(lines), words)


def chapters(source: str) -> list[Chapter]:
    """The module's chapters, by their banners, in the file's order; their "Uses:" read."""
    lines = source.splitlines()
    found = list(banners(lines))
    for chapter, after in itertools.pairwise(found):
        chapter.last = after.first - 1
    for index, chapter in enumerate(found):
        try:
            chapter.says = uses_text(chapter.banner)
            chapter.listed = listed(chapter.banner, [c.number for c in found[:index]])
        except ValueError as error:
            chapter.error = str(error)
    return found


def uses_text(banner: str) -> str:
    """What a banner's "Uses:" says, up to its full stop, its notes in parentheses left out."""
    if not USES.search(banner):
        raise ValueError('no "Uses:"')
    text = USES.split(banner, maxsplit=1)[1]
    while (bare := re.sub(r"\([^()]*\)", "", text)) != text:
        text = bare
    return re.sub(r"\s+,", ",", " ".join(text.split(".", 1)[0].split()))


def listed(banner: str, above: Sequence[int]) -> set[int]:
    """The chapters a banner's "Uses:" names (see the module's docstring)."""
    text = uses_text(banner)
    if text.lower() in ("nothing", "none"):
        return set()
    if text.lower() == "all above":
        return set(above)
    numbers: set[int] = set()
    for part in re.split(r",|\band\b", text):
        if not (part := part.strip()):
            continue
        if span := re.fullmatch(r"(\d+)\s*[-–]\s*(\d+)", part):
            numbers |= set(range(int(span[1]), int(span[2]) + 1))
        elif part.isdigit():
            numbers.add(int(part))
        else:
            raise ValueError(f'cannot read {part!r} in "Uses: {text}"')
    return numbers


def ranges(numbers: Iterable[int]) -> str:
    """``1-3, 5, 10-11``: runs of numbers as ranges."""
    runs: list[list[int]] = []
    for number in sorted(numbers):
        if runs and number == runs[-1][-1] + 1:
            runs[-1].append(number)
        else:
            runs.append([number])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def as_uses(numbers: Iterable[int]) -> str:
    """The banner's words: ``Uses: 1-3, 5, 10-11.``, or ``Uses: nothing.``"""
    return f"Uses: {ranges(numbers) or 'nothing'}."


# --- which names a chapter defines and which it takes


def bound_at_top(node: ast.stmt) -> set[str]:
    """The names a top-level statement defines (not its imports): under if, try or with too."""
    match node:
        case ast.FunctionDef() | ast.AsyncFunctionDef() | ast.ClassDef():
            return {node.name}
        case ast.Assign():
            return {name for target in node.targets for name in stored(target)}
        case ast.AnnAssign():
            return stored(node.target)
        case _ if type(node).__name__ == "TypeAlias":  # type X = ... (Python 3.12)
            return stored(getattr(node, "name"))  # noqa: B009  (no ast.TypeAlias on 3.11)
    names: set[str] = set()
    for statement in inner_statements(node):
        names |= bound_at_top(statement)
    return names


def inner_statements(node: ast.stmt) -> list[ast.stmt]:
    """What an if, try, with or loop holds (each part of it)."""
    held: list[ast.stmt] = []
    for block in ("body", "orelse", "finalbody"):
        held += getattr(node, block, [])
    for part in [*getattr(node, "handlers", []), *getattr(node, "cases", [])]:
        held += part.body
    return held


def stored(target: ast.expr) -> set[str]:
    """The plain names an assignment target binds (``a``, ``a, *b``)."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, ast.Tuple | ast.List):
        return {name for element in target.elts for name in stored(element)}
    if isinstance(target, ast.Starred):
        return stored(target.value)
    return set()


NESTED_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def own_names(scope: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> set[str]:
    """The names a function or lambda binds for itself: its parameters and what its body
    assigns, imports, defines or catches (not inside nested scopes), less its globals."""
    arguments = scope.args
    every = (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)
    names = {a.arg for a in (*every, arguments.vararg, arguments.kwarg) if a}
    if isinstance(scope, ast.Lambda):
        return names
    declared: set[str] = set()
    pending: list[ast.AST] = list(scope.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Global | ast.Nonlocal):
            declared.update(node.names)
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler | ast.MatchAs | ast.MatchStar) and node.name:
            names.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            names.add(node.rest)
        if isinstance(node, NESTED_SCOPES):
            if not isinstance(node, ast.Lambda):
                names.add(node.name)
            continue  # what it binds is its own
        if isinstance(node, COMPREHENSIONS):  # its targets are its own; a walrus is ours
            pending += [n for n in ast.walk(node) if isinstance(n, ast.NamedExpr)]
            continue
        pending += ast.iter_child_nodes(node)
    return names - declared


class GlobalNames(ast.NodeVisitor):
    """The module-level names a top-level statement refers to."""

    def __init__(self) -> None:
        self.found: set[str] = set()
        self.scopes: list[tuple[str, set[str]]] = []  # ("function" | "class", its names)

    def of(self, node: ast.AST) -> set[str]:
        self.visit(node)
        return self.found

    def refer(self, name: str, ctx: ast.expr_context) -> None:
        for depth, (kind, names) in enumerate(reversed(self.scopes)):
            if kind == "class":
                if depth > 0:
                    continue  # a class's names are not seen from its methods
                if not isinstance(ctx, ast.Load):
                    return  # a class's own attribute, assigned in its body
            if name in names:
                return  # the function's (or lambda's, comprehension's) own
        self.found.add(name)

    def visit_Name(self, node: ast.Name) -> None:
        self.refer(node.id, node.ctx)

    def annotation(self, node: ast.expr | None) -> None:
        """An annotation, with the names in its strings."""
        if node is None:
            return
        for part in ast.walk(node):
            if isinstance(part, ast.Constant) and isinstance(part.value, str):
                self.named_in(part.value)
        self.visit(node)

    def named_in(self, text: str) -> None:
        try:
            expression = ast.parse(text.strip(), mode="eval")
        except SyntaxError:
            return
        self.annotation(expression.body)

    def visit_Call(self, node: ast.Call) -> None:
        called = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        if called in NAMING_CALLS:
            count = NAMING_CALLS[called]
            naming = node.args[:count] if count is not None else node.args[1:]
            naming += [k.value for k in node.keywords if k.arg == "bound"]
            for argument in naming:
                if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                    self.named_in(argument.value)
        self.generic_visit(node)

    def signature(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        """What a def or lambda evaluates where it stands: defaults, annotations, decorators."""
        arguments = node.args
        for default in (*arguments.defaults, *(d for d in arguments.kw_defaults if d)):
            self.visit(default)
        if isinstance(node, ast.Lambda):
            return
        for decorator in node.decorator_list:
            self.visit(decorator)
        every = (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)
        for argument in (*every, arguments.vararg, arguments.kwarg):
            self.annotation(argument.annotation if argument else None)
        self.annotation(node.returns)

    def in_scope(self, kind: str, names: set[str], body: Iterable[ast.AST]) -> None:
        self.scopes.append((kind, names))
        for node in body:
            self.visit(node)
        self.scopes.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.signature(node)
        self.in_scope("function", own_names(node), node.body)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.signature(node)
        self.in_scope("function", own_names(node), [node.body])

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for outside in (*node.decorator_list, *node.bases, *(k.value for k in node.keywords)):
            self.visit(outside)
        names = {name for statement in node.body for name in bound_at_top(statement)}
        self.in_scope("class", names, node.body)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.annotation(node.annotation)
        self.visit(node.target)
        if node.value is not None:
            self.visit(node.value)

    def visit_comprehension_(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp) -> None:
        self.comprehension(node, [node.elt])

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_comprehension_

    def visit_DictComp(self, node: ast.DictComp) -> None:
        self.comprehension(node, [node.key, node.value])

    def comprehension(self, node: ast.expr, results: list[ast.expr]) -> None:
        generators: list[ast.comprehension] = getattr(node, "generators")  # noqa: B009
        self.visit(generators[0].iter)  # evaluated where the comprehension stands
        targets = {name for g in generators for name in stored(g.target)}
        rest: list[ast.AST] = [*results, *(g.iter for g in generators[1:])]
        rest += [condition for g in generators for condition in g.ifs]
        self.in_scope("function", targets, rest)


def shape(source: str) -> list[Chapter]:
    """The chapters, each with the names it defines and those it takes from the others."""
    found = chapters(source)
    tree = ast.parse(source)

    def chapter_of(node: ast.stmt) -> Chapter | None:
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        return next((c for c in found if c.first <= first <= c.last), None)

    owner: dict[str, int] = {}
    for node in tree.body:
        if (chapter := chapter_of(node)) is not None:
            chapter.defines |= bound_at_top(node)
            for name in bound_at_top(node):
                owner.setdefault(name, chapter.number)  # the first definition is the name's
    for node in tree.body:
        if (chapter := chapter_of(node)) is None:
            continue
        for name in GlobalNames().of(node):
            if (source_chapter := owner.get(name, chapter.number)) != chapter.number:
                chapter.takes.setdefault(source_chapter, set()).add(name)
    return found


def report(found: Sequence[Chapter]) -> str:
    """Every chapter's "Uses:" as its code has it; what differs from its banner, by name."""
    lines = []
    for chapter in found:
        mark = "  " if chapter.right else "✗ "
        lines.append(f"{mark}{chapter.number:>2}. {chapter.title}: {as_uses(chapter.used)}")
        if chapter.error:
            lines.append(f"       its banner's Uses cannot be read: {chapter.error}")
        elif not chapter.right:
            assert chapter.listed is not None
            lines.append(f"       its banner says: Uses: {chapter.says}.")
            for number in sorted(chapter.used - chapter.listed):
                names = ", ".join(sorted(chapter.takes[number]))
                lines.append(f"       not listed: {number}, for {names}")
            if extra := chapter.listed - chapter.used:
                lines.append(f"       listed, not used: {ranges(extra)}")
    return "\n".join(lines)


def test_each_banners_uses_lists_the_chapters_whose_names_it_takes() -> None:
    found = shape(SOURCE.read_text())
    assert found, f"no chapter banners in {SOURCE}"
    wrong = [chapter.number for chapter in found if not chapter.right]
    assert not wrong, (
        f'chapters {wrong} list other chapters in their "Uses:" than they take names from; '
        "what each uses (✗: not what its banner says; notes in parentheses are yours):\n"
        + report(found)
    )


RULE_LINE = "# " + "=" * 40
SYNTHETIC = f"""
from typing import Final, cast

{RULE_LINE}
# 1. Names
# Holds A and B. Uses: nothing.
{RULE_LINE}

A: Final = 1
B = cast("int", A) + len([A for A in range(3)])  # A: chapter 1's own


{RULE_LINE}
# 2. Functions
# Holds f. Uses: 1 (the names, in a note that
# wraps), 3.
{RULE_LINE}


def f(thing: "C", A: int = 0) -> int:  # C: chapter 3; A: f's own parameter
    return thing.n + A


{RULE_LINE}
# 3. Classes
# Holds C. Uses: 1.
{RULE_LINE}


class C:
    f = B  # C.f: C's own; B: chapter 1's

    def g(self) -> int:
        return f(self)  # chapter 2's f, not C.f
"""


def test_the_uses_check_finds_a_chapter_not_listed_and_one_listed_not_used() -> None:
    found = shape(SYNTHETIC)
    assert [(c.number, c.title, c.defines) for c in found] == [
        (1, "Names", {"A", "B"}),
        (2, "Functions", {"f"}),
        (3, "Classes", {"C"}),
    ]
    assert [c.listed for c in found] == [set(), {1, 3}, {1}]
    assert [c.takes for c in found] == [{}, {3: {"C"}}, {1: {"B"}, 2: {"f"}}]
    assert [c.right for c in found] == [True, False, False]
    said = report(found)
    assert "✗  2. Functions: Uses: 3." in said and "listed, not used: 1" in said
    assert "✗  3. Classes: Uses: 1-2." in said and "not listed: 2, for f" in said
    assert as_uses([1, 2, 3, 5, 10, 11]) == "Uses: 1-3, 5, 10-11."
    assert listed("x. Uses: all above.", [1, 2]) == {1, 2}
    assert listed("Uses: 1-3, 6-7 (the bodies\tand legs), 8 (routing).", []) == {1, 2, 3, 6, 7, 8}


if __name__ == "__main__":
    print(report(shape(SOURCE.read_text())))
