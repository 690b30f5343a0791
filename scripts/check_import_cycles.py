"""Fail when modules of a package import each other in a loop (CI's lint step runs it on tritonep).

Every import counts: at module level, inside functions and under ``TYPE_CHECKING``. A loop that
only type hints close is still two modules that cannot be read, or moved, one without the other.
``from package import name`` is an edge to the submodule when ``name`` is one, else to the
package's ``__init__``; the implicit import of parent packages is not an edge.

    python scripts/check_import_cycles.py [PACKAGE_DIR ...]    (default: tritonep)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_names(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``package_dir``."""
    root = package_dir.parent
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` (at ``path``) imports."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in modules and target != name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def main(package_dirs: list[str]) -> int:
    status = 0
    for package_dir in package_dirs:
        modules = module_names(Path(package_dir).resolve())
        graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
        for component in cycles(graph):
            status = 1
            ties = "; ".join(f"{a} -> {b}" for a in component for b in sorted(graph[a]) if b in component)
            print(f"import cycle: {', '.join(component)} ({ties})")
        if not status:
            print(f"check_import_cycles: {len(modules)} modules of {package_dir}, no import cycle")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["tritonep"]))
