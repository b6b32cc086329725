"""MkDocs hooks: the navigation's model-family pages come from the registry, as the pages do (docs/gen_pages.py),
so a new family needs no edit here or in mkdocs.yml."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from families import families  # noqa: E402

#: The nav entry of mkdocs.yml that the family pages replace.
PLACEHOLDER = "models/families/"


def on_config(config):
    def expand(items):
        out = []
        for item in items:
            if isinstance(item, dict):
                ((title, value),) = item.items()
                if value == PLACEHOLDER:
                    out.append(
                        {title: [f"models/families/{name}.md" for name, _, _ in families()]}
                    )  # titled by the page
                    continue
                if isinstance(value, list):
                    item = {title: expand(value)}
            out.append(item)
        return out

    config["nav"] = expand(config["nav"])
    return config


def _package_tree() -> None:
    """Lay the ``solrl`` package out as installed under ``.cache/docs/src/solrl`` (symlinks), so that
    mkdocstrings' static analysis (griffe) finds ``solrl.stages`` and the other folders pyproject.toml maps into
    the package; the mapping is read from pyproject.toml, not typed here."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    repo = Path(__file__).resolve().parents[1]
    package_dir = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    root = repo / ".cache" / "docs" / "src"
    for name, folder in sorted(package_dir.items()):
        link = root.joinpath(*name.split("."))
        if name == "solrl":  # the top package: its own modules, beside the mapped sub-packages
            link.mkdir(parents=True, exist_ok=True)
            for item in (repo / folder).iterdir():
                if item.name != "__pycache__" and not (link / item.name).is_symlink():
                    (link / item.name).symlink_to(item)
        elif not link.is_symlink():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(repo / folder, target_is_directory=True)


_package_tree()
