"""The import graph, parsed with `ast` (imports inside functions included): no cycles between
files, nothing imports upward (cli -> configs -> trainer -> models -> sharding -> kernels; the
runtime part of sharding/ never imports its analysis rooms plan/ and xla/), and tests and
benchmarks import only public names of ours, never each other's files by path."""

import ast
import os
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
LIBRARY = ("cli", "configs", "trainer", "models", "sharding", "kernels")
ROOTS = (*LIBRARY, "tests", "benchmarks")
# Higher imports lower or equal, never higher. sharding's analysis rooms sit above its runtime.
RANK = {"kernels": 0, "sharding": 1, "sharding.plan": 2, "sharding.xla": 2, "models": 3,
        "trainer": 4, "configs": 5, "cli": 6}


def modules() -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every .py under the roots (a package's __init__ by the
  package's name)."""
  out = {}
  for root in ROOTS:
    for path in (REPO / root).rglob("*.py"):
      parts = path.relative_to(REPO).with_suffix("").parts
      name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
      out[name] = path
  return out


MODULES = modules()


def _target(dotted: str) -> str | None:
  """The module a dotted import name lands in: itself, or its longest module prefix."""
  while dotted and dotted not in MODULES:
    dotted = dotted.rpartition(".")[0]
  return dotted or None


def imports(name: str) -> list[tuple[str, str | None, int]]:
  """(module imported, name imported from it or None, line) for every import of `name`'s file,
  at any depth, resolved to our modules (third-party imports left out)."""
  path = MODULES[name]
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  out = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if (target := _target(alias.name)) is not None:
          out.append((target, None, node.lineno))
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                        + ([base] if base else []))
      for alias in node.names:
        full = f"{base}.{alias.name}"
        if full in MODULES:  # `from package import module`
          out.append((full, None, node.lineno))
        elif (target := _target(base)) is not None:
          out.append((target, alias.name, node.lineno))
  return out


GRAPH = {name: imports(name) for name in MODULES}


def _rank(module: str) -> int | None:
  for prefix in sorted(RANK, key=len, reverse=True):
    if module == prefix or module.startswith(prefix + "."):
      return RANK[prefix]
  return None


def test_no_cycles_between_files():
  edges = {a: {b for b, _, _ in GRAPH[a] if b != a} for a in GRAPH}
  index, low, stack, on_stack, cycles = {}, {}, [], set(), []

  def visit(v):  # Tarjan's strongly connected components
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in edges[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        cycles.append(sorted(component))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  assert not cycles, f"import cycles: {cycles}"


def test_nothing_imports_upward():
  upward = [f"{a} imports {b} (line {line})" for a in GRAPH if _rank(a) is not None
            for b, _, line in GRAPH[a] if _rank(b) is None or _rank(b) > _rank(a)]
  assert not upward, "\n".join(upward)


def test_library_never_imports_tests_or_benchmarks():
  wrong = [f"{a} imports {b}" for a in GRAPH if a.split(".")[0] in LIBRARY
           for b, _, _ in GRAPH[a] if b.split(".")[0] in ("tests", "benchmarks")]
  assert not wrong, wrong


def _private(name: str) -> bool:
  return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


def test_tests_and_benchmarks_use_public_names_only():
  """No `_name` imported from our modules, no `module._name` read through an imported module of
  ours; benchmarks never import tests."""
  wrong = []
  for name, path in MODULES.items():
    if name.split(".")[0] not in ("tests", "benchmarks"):
      continue
    ours = {}  # local name bound to one of our modules
    for module, imported, line in GRAPH[name]:
      if name.startswith("benchmarks") and module.split(".")[0] == "tests":
        wrong.append(f"{name}:{line} imports {module}")
      if _private(module) or (imported and _private(imported)):
        wrong.append(f"{name}:{line} imports {module}.{imported or ''}")
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module:
        for alias in node.names:
          if f"{node.module}.{alias.name}" in MODULES:
            ours[alias.asname or alias.name] = f"{node.module}.{alias.name}"
      elif isinstance(node, ast.Import):
        for alias in node.names:
          if _target(alias.name):
            ours[alias.asname or alias.name.split(".")[0]] = alias.name
    for node in ast.walk(tree):
      if isinstance(node, ast.Attribute) and _private(node.attr):
        chain, base = [node.attr], node.value
        while isinstance(base, ast.Attribute):
          chain.append(base.attr)
          base = base.value
        if isinstance(base, ast.Name) and base.id in ours:
          wrong.append(f"{name}:{node.lineno} reads {base.id}.{'.'.join(reversed(chain))}")
  assert not wrong, "\n".join(wrong)


def test_no_sys_path_changes_in_tests_and_benchmarks():
  """Our modules are imported as packages from the repository root, never by file path."""
  wrong = []
  for name, path in MODULES.items():
    if name.split(".")[0] not in ("tests", "benchmarks"):
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if (isinstance(node, ast.Attribute) and node.attr in ("insert", "append", "extend")
          and isinstance(node.value, ast.Attribute) and node.value.attr == "path"
          and isinstance(node.value.value, ast.Name) and node.value.value.id == "sys"):
        wrong.append(f"{name}:{node.lineno}")
  assert not wrong, wrong


@pytest.mark.parametrize("bad, message", [
    ({"trainer.x": [("configs", None, 1)]}, "imports configs"),
    ({"models.x": [("models.y", None, 1)], "models.y": [("models.x", None, 1)]}, "cycles"),
])
def test_the_checks_catch_a_violation(monkeypatch, bad, message):
  """The checks above fail on a planted upward import and a planted cycle."""
  for name in bad:
    monkeypatch.setitem(MODULES, name, pathlib.Path(os.devnull))
  monkeypatch.setattr(sys.modules[__name__], "GRAPH", {**GRAPH, **bad})
  with pytest.raises(AssertionError, match=message):
    test_nothing_imports_upward()
    test_no_cycles_between_files()
