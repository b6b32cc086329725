"""MkDocs hooks: the navigation's model-family pages come from the registry, as the pages do (docs/gen_pages.py),
so a new family needs no edit here or in mkdocs.yml; so do the built-in names of the extending page's table."""

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


#: The extending page's markers, replaced by each registry's built-in names (``built_ins``).
BUILT_INS = {
    "model.family": "MODELS",
    "reward": "REWARDS",
    "explore.precision": "EXPLORE_BACKENDS",
    "train.loss": "LOSSES",
}


def built_ins(markdown: str) -> str:
    """``markdown`` with each ``<!-- built-ins: POINT -->`` marker replaced by that registry's built-in names, in
    code spans, in registry (name) order.

    Raises:
        ValueError: a marker names no registry, or a registry's marker is missing.
    """
    import re

    import solrl.registry as registry

    found = re.findall(r"<!-- built-ins: ([^ ]+) -->", markdown)
    if sorted(found) != sorted(BUILT_INS):
        raise ValueError(f"the extending page's built-in markers are {found}, not one of each of {list(BUILT_INS)}")
    for point, name in BUILT_INS.items():
        names = ", ".join(f"`{n}`" for n in sorted(getattr(registry, name).index()))
        markdown = markdown.replace(f"<!-- built-ins: {point} -->", names)
    return markdown


def on_page_markdown(markdown, page, config, files):
    return built_ins(markdown) if page.file.src_uri == "extending/index.md" else markdown


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
