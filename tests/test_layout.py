"""The layout targets of ``rnndrop/``: no import cycle among its modules, no import that runs
upward through the layers, imports at the top. Module and function length is left to judgement:
an idea is kept whole rather than cut to a line count. The checks read the source with
:mod:`ast` and import nothing."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "rnndrop"


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (``__init__`` is the package)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports, wherever the import statement is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    graph = import_graph()
    assert "rnndrop.lm.run.train" in graph["rnndrop.lm"]  # the graph sees the package's imports


def test_no_cycle_among_rnndrop_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


#: The layers, lowest first: a module may import from its own layer and the ones below.
LAYERS = ("rnndrop", "rnndrop.lm.data", "rnndrop.lm.model", "rnndrop.lm.run",
          "rnndrop.lm.cli", "rnndrop.lm")


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of the longest prefix of ``module``."""
    matches = [prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")]
    return LAYERS.index(max(matches, key=len))


def upward_imports() -> list[str]:
    return [
        f"{name} imports {imported}"
        for name, imports in import_graph().items()
        for imported in sorted(imports)
        if layer_of(imported) > layer_of(name)
    ]


def test_data_flows_one_way_through_the_layers():
    """The library never imports rnndrop.lm; data <- model <- run <- cli inside it."""
    assert layer_of("rnndrop.masks") == 0 and layer_of("rnndrop.lm.run.train") == 3
    assert layer_of("rnndrop.lm") == 5 and layer_of("rnndrop.lm.cli.parser") == 4
    assert not upward_imports(), "\n".join(upward_imports())


#: What a function may import inside its body: dependencies that are optional extras, torch's
#: C++ extension builder (it imports setuptools: only the compiled kernel's build needs it), and
#: Triton with the kernel modules that import it at their top (``import rnndrop`` never imports it).
OPTIONAL = ("matplotlib", "tqdm", "torch.utils.tensorboard", "datasets", "torch.utils.cpp_extension",
            "triton", "rnndrop.kernels.triton_", "safetensors")


def imports_inside_functions() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import):
                    names = [alias.name for alias in inner.names]
                elif isinstance(inner, ast.ImportFrom):
                    names = [inner.module or "."]
                else:
                    continue
                for name in names:
                    if not name.startswith(OPTIONAL):
                        out.append(f"{path.relative_to(PACKAGE.parent)}:{inner.lineno} {name}")
    return out


def test_imports_are_at_the_top_except_optional_dependencies():
    assert not imports_inside_functions(), "\n".join(imports_inside_functions())


if __name__ == "__main__":  # python tests/test_layout.py: what the targets flag
    print("cycle:", find_cycle(import_graph()))
    print("\n".join(upward_imports() + imports_inside_functions()))


def test_the_module_map_names_every_module():
    """docs/modules.md has a row for every module of the package, and no row for one that is gone."""
    text = (PACKAGE.parent / "docs" / "modules.md").read_text(encoding="utf-8")
    files = {str(path.relative_to(PACKAGE.parent)) for path in PACKAGE.rglob("*.py")}
    files -= {str(path.relative_to(PACKAGE.parent)) for path in PACKAGE.rglob("__init__.py")
              if path.parent.name in ("data", "model", "run", "mc")}
    missing = sorted(f for f in files if f"`{f}`" not in text)
    named = set(re.findall(r"`(rnndrop/[\w/]+\.py)`", text))
    gone = sorted(named - {str(path.relative_to(PACKAGE.parent)) for path in PACKAGE.rglob("*.py")})
    assert not missing and not gone, f"not in docs/modules.md: {missing}; named there but gone: {gone}"


def test_the_public_names_table_names_every_public_name():
    """docs/modules.md's table of public names lists every name of ``rnndrop.__all__`` (it had
    missed compile_model, CompiledModel and LanguageModelLoss)."""
    import rnndrop

    text = (PACKAGE.parent / "docs" / "modules.md").read_text(encoding="utf-8")
    table = text.split("## Library `rnndrop/`: public names", 1)[1].split("\n## ", 1)[0]
    missing = sorted(name for name in rnndrop.__all__ if f"`{name}`" not in table)
    assert not missing, f"not in docs/modules.md's public names: {missing}"

