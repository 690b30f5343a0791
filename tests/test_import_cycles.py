"""The import-cycle check that CI's lint step runs: it finds a loop, and tritonep has none."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _checker():
    spec = importlib.util.spec_from_file_location("check_import_cycles", ROOT / "scripts" / "check_import_cycles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_loop_through_a_type_checking_import_is_found(tmp_path: Path) -> None:
    package = tmp_path / "house"
    (package / "rooms").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "rooms" / "__init__.py").write_text("")
    (package / "hall.py").write_text("from house.rooms import kitchen\n")
    (package / "rooms" / "kitchen.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..hall import Hall\n")
    (package / "garden.py").write_text("from house import hall\n")
    checker = _checker()
    modules = checker.module_names(package)
    graph = {name: checker.imports_of(name, path, modules) for name, path in modules.items()}
    assert checker.cycles(graph) == [["house.hall", "house.rooms.kitchen"]]
    assert checker.main([str(package)]) == 1


def test_tritonep_has_no_import_cycle() -> None:
    assert _checker().main([str(ROOT / "tritonep")]) == 0
