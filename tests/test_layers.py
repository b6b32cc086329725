"""The layer rule (DESIGN 3): flows -> stages -> storage -> solrl config; nothing imports back up.

The ``pyproject.toml`` package mapping (``solrl.stages`` is the folder ``stages/``) hides these imports from
static tools, so this test reads every module's imports, function-level ones included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Folder -> import package, as ``[tool.setuptools] package-dir`` maps them.
PACKAGES = {"solrl": "solrl", "flows": "solrl.flows", "stages": "solrl.stages", "storage": "solrl.storage"}
#: Lower may be imported by higher; the CLI is the entry point and may import anything.
LAYERS = {"solrl": 0, "solrl.storage": 1, "solrl.stages": 2, "solrl.flows": 3, "solrl.cli": 4}


def layer(module: str) -> int:
    best = max((name for name in LAYERS if module == name or module.startswith(name + ".")), key=len)
    return LAYERS[best]


def modules() -> list[tuple[str, Path]]:
    found = []
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join([package, *parts]).removesuffix(".__init__")
            found.append((name, path))
    return found


def imports(path: Path, module: str) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = package[: len(package) - (node.level - 1)]
                names.append(".".join([*base, *([node.module] if node.module else [])]))
            else:
                names.append(node.module or "")
    return [n for n in names if n == "solrl" or n.startswith("solrl.")]


def test_every_package_folder_is_scanned():
    assert len(modules()) > 30


@pytest.mark.parametrize(("module", "path"), modules(), ids=[m for m, _ in modules()])
def test_no_module_imports_a_higher_layer(module: str, path: Path):
    upward = [name for name in imports(path, module) if layer(name) > layer(module)]
    assert not upward, (
        f"{module} (layer {layer(module)}) imports {upward}: dependencies point flows -> stages -> "
        f"storage -> solrl config"
    )
