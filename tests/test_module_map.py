"""The module map in docs/design.md is the package as it is: every module is in it, everything in it
exists, and every import points down its layers (none up, no circle). The README names the packages
only, and the same ones."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "llama_shard"
ROW = re.compile(r"^\| (\d+(?:\.\d+)?) \| (.+?) \| .* \|$")


def module_map() -> dict[str, tuple[int, int]]:
    """module path (relative to the package, or `_native`) -> (package layer, inner layer)."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("### Module map") :]
    section = section[: section.index("\n\n", section.index("| --- |"))]
    layers = {}
    for line in section.splitlines():
        m = ROW.match(line)
        if m is None:
            continue
        outer, _, inner = m.group(1).partition(".")
        for name in re.findall(r"`([^`]+)`", m.group(2)):
            layers[name] = (int(outer), int(inner or 0))
    return layers


def package_modules() -> list[str]:
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_map_names_every_module_and_only_modules_that_exist():
    mapped = set(module_map())
    assert "_native" in mapped
    modules = set(package_modules())
    assert modules - mapped == set(), "modules missing from docs/design.md's module map"
    assert mapped - modules - {"_native"} == set(), "the module map names modules that do not exist"


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module path) of every relative import that runs (TYPE_CHECKING ones do not)."""
    rel = path.relative_to(PACKAGE)
    here = list(rel.parent.parts)
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for n in ast.walk(node))
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or not node.level or id(node) in skipped:
            continue
        base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
        targets = [base + node.module.split(".")] if node.module else [base + [a.name] for a in node.names]
        for parts in targets:
            out.append((node.lineno, _resolve(parts)))
    return out


def _resolve(parts: list[str]) -> str:
    if parts == ["_native"]:
        return "_native"
    as_file = PACKAGE.joinpath(*parts).with_suffix(".py")
    if as_file.exists():
        return str(as_file.relative_to(PACKAGE))
    as_package = PACKAGE.joinpath(*parts, "__init__.py")
    if as_package.exists():
        return str(as_package.relative_to(PACKAGE))
    return _resolve(parts[:-1])  # a name imported from a module


def _package(module: str) -> str:
    return module.split("/")[0] if "/" in module else module


def test_every_import_points_down_the_map():
    layers = module_map()
    wrong = []
    for module in package_modules():
        source = PACKAGE / module
        mine = layers[module]
        for line, target in _imports(source):
            theirs = layers[target]
            if _package(target) == _package(module):
                ok = theirs[1] <= mine[1] and target != module
            else:
                ok = theirs[0] < mine[0]
            if not ok:
                wrong.append(f"{module}:{line} ({mine[0]}.{mine[1]}) imports {target} ({theirs[0]}.{theirs[1]})")
    assert wrong == [], "imports that point up the module map:\n" + "\n".join(wrong)


def test_the_import_graph_has_no_circle():
    graph = {m: {t for _, t in _imports(PACKAGE / m) if t != "_native"} for m in package_modules()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(nxt_ := node, ()):
            if state.get(nxt) == 1:
                raise AssertionError("an import circle: " + " -> ".join(path + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[nxt_] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])


def test_the_readme_names_the_packages_of_the_map():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Architecture") : readme.index("## Performance")]
    packages = {m.split("/")[0] for m in module_map() if "/" in m}
    named = set(re.findall(r"^   (\w+)/ ", section, re.M))
    assert named == packages
    assert "docs/design.md#module-map" in section


def test_a_plain_worker_loads_nothing_of_the_head():
    """Every worker's code (worker/) imports none of the head's (head/), not even lazily: the head
    sits on a worker through `HeadSlot` only."""
    import subprocess
    import sys

    for module in package_modules():
        if module.startswith("worker/"):
            assert not [t for _, t in _imports(PACKAGE / module) if t.startswith("head/")], module
    code = (
        "import sys, llama_shard.worker.servicer; "
        "print(sorted(m for m in sys.modules if m.startswith('llama_shard.head')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _self_attributes(cls: ast.ClassDef) -> set[str]:
    return {
        node.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and isinstance(node.ctx, ast.Store)
    }


def test_the_rooms_keep_their_bounds():
    """A part that grows past its bounds is split by what it does (docs/design.md, Habits): no
    function over 80 lines, no file over 600 (generated code and the tests' support in testing/
    aside), no class over 30 attributes (options dataclasses aside), `Stream` at most 12 fields of
    its own; the native sources too (their functions: lizard, in the review)."""
    over = []
    for module in package_modules():
        if module.startswith("testing/") or module.endswith("_pb2.py") or module.endswith("_pb2_grpc.py"):
            continue
        text = (PACKAGE / module).read_text()
        if text.count("\n") > 600:
            over.append(f"{module}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                over.append(f"{module}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
            dataclass = isinstance(node, ast.ClassDef) and any(
                "dataclass" in ast.unparse(d) for d in node.decorator_list
            )
            if isinstance(node, ast.ClassDef) and not dataclass and len(_self_attributes(node)) > 30:
                over.append(f"{module}:{node.lineno} {node.name}: {len(_self_attributes(node))} attributes")
    for path in [*ROOT.glob("native/src/*"), *ROOT.glob("native/bindings/*"), *ROOT.glob("native/include/*/*.h")]:
        if path.read_text().count("\n") > 600:
            over.append(f"{path.relative_to(ROOT)}: {path.read_text().count(chr(10))} lines")
    assert over == [], "past the house's bounds:\n" + "\n".join(over)
    stream = ast.parse((PACKAGE / "head" / "generation" / "stream.py").read_text())
    cls = next(n for n in stream.body if isinstance(n, ast.ClassDef) and n.name == "Stream")
    slots = next(n for n in cls.body if isinstance(n, ast.Assign) and n.targets[0].id == "__slots__")
    assert len(ast.literal_eval(slots.value)) <= 12
