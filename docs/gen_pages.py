"""The site's generated pages, written by mkdocs-gen-files at build time (never committed).

- ``reference/config.md``: every config field from the pydantic models: type, default, whether it is in the
  config hash, description.
- ``reference/cli.md``: the command line, from the CLI itself (typer's own docs generator).
- ``models/families/<family>.md``: one page per registered model family (tiny twins on their family's page):
  the adapter's module docstring and the presets that use the family, resolved by the config loader.
- ``development/results/``: the benchmark tables and plots of ``bench/results/``.

Run by ``mkdocs build`` from the repository root; ``docs/hooks.py`` adds the family pages to the navigation.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import types
import typing
from pathlib import Path

import mkdocs_gen_files
from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).parent))
from families import families  # noqa: E402  (docs/families.py, shared with docs/hooks.py)

from solrl.config import LAYOUT_FIELDS, RunConfig, list_presets, load_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _type_name(annotation: object) -> str:
    if annotation is None or annotation is type(None):
        return "None"
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(annotation, "__name__", str(annotation))


def _field_type(field: typing.Any) -> str:
    """The field's type with its bounds (``int (>= 2, <= 4096)``), so that the page says what ``--set`` accepts."""
    bounds = {kind: getattr(m, kind) for m in field.metadata for kind in ("ge", "gt", "le", "lt") if hasattr(m, kind)}
    words = {"ge": ">= {}", "gt": "> {}", "le": "<= {}", "lt": "< {}"}
    ranged = ", ".join(words[kind].format(value) for kind, value in bounds.items())
    return _type_name(field.annotation) + (f" ({ranged})" if ranged else "")


def _default(field: typing.Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{value!r}`"


def config_reference() -> str:
    layout = set(LAYOUT_FIELDS)
    out = [
        "# Configuration reference",
        "",
        "Generated from the pydantic models in `solrl/config.py` when the site is built. A preset (YAML in "
        "`configs/`) or `--set section.key=value` sets any of these; unknown keys are an error. *Hashed* fields "
        "make the config hash, which names a run's cache keys: changing one makes committed stages stale. "
        "*Layout* fields lay the work out without changing a result, so `solrl resume` may change them.",
        "",
        "| field | type | default | hashed | description |",
        "| --- | --- | --- | --- | --- |",
    ]
    sections = []
    for name, field in RunConfig.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            sections.append((name, annotation))
            continue
        hashed = "no (set by the loader)" if name == "base_dir" else "yes"
        out.append(
            f"| `{name}` | {_field_type(field)} | {_default(field)} | {hashed} | {_cell(field.description or '')} |"
        )
    for section, model in sections:
        out += ["", f"## `{section}`", "", _cell((model.__doc__ or "").strip()), ""]
        out += ["| field | type | default | hashed | description |", "| --- | --- | --- | --- | --- |"]
        for key, field in model.model_fields.items():
            hashed = "no (layout)" if (section, key) in layout else "yes"
            out.append(
                f"| `{section}.{key}` | {_field_type(field)} | {_default(field)} | {hashed} | "
                f"{_cell(field.description or '')} |"
            )
    return "\n".join(out) + "\n"


def cli_reference() -> str:
    command = [sys.executable, "-m", "typer", "solrl.cli", "utils", "docs", "--name", "solrl"]
    text = subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPO).stdout
    intro = (
        "Generated from the CLI itself (`typer solrl.cli utils docs`) when the site is built: the same text "
        "as `solrl COMMAND --help`.\n\n"
    )
    title, _, rest = text.partition("\n")
    return f"# Command line reference\n\n{intro}{title.replace('# ', '## ', 1)}\n{rest}"


def family_page(family: str, twin: bool, module: str, configs: list[RunConfig]) -> str:
    presets = [cfg for cfg in configs if cfg.model.family == family]
    tiny = [cfg.name for cfg in presets if cfg.model.source == "tiny"]
    display = (importlib.import_module(module).__doc__ or family).split(" (")[0].strip()  # "SANA", "FLUX.2"
    twin_line = "; `model.source: tiny` runs its tiny CPU twin" + (f" (preset `{'`, `'.join(tiny)}`)" if tiny else "")
    out = [
        f"# {display} (`{family}`)",
        "",
        f"`model.family: {family}`" + (twin_line if twin else "") + ".",
        "",
        "## Presets",
        "",
        "| preset | resolution | explore | pool -> keep | steps explore / train | loss | rewards (weight) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cfg in presets:
        rewards = ", ".join(f"{name} ({weight:g})" for name, weight in cfg.reward.weights.items())
        resolution = cfg.model.resolution or "family default"
        if cfg.model.num_frames:
            resolution = f"{resolution} x {cfg.model.num_frames} frames"
        out.append(
            f"| `{cfg.name}` | {resolution} | {cfg.explore.precision} | "
            f"{cfg.explore.pool_size} -> {cfg.select.k} | {cfg.explore.steps} / {cfg.regenerate.steps} | "
            f"{cfg.train.loss} | {rewards} |"
        )
    out += [
        "",
        f"`solrl run {presets[0].name}` runs one; `solrl plan {presets[0].name}` says whether it fits your GPU "
        "([the memory plan](../../scaling/memory.md)).",
        "",
        "## The adapter",
        "",
        f"::: {module}",
        "    options:",
        "      show_root_heading: false",
        "      show_root_toc_entry: false",
        "      members: false",
        "",
    ]
    return "\n".join(out)


with mkdocs_gen_files.open("reference/config.md", "w") as f:
    f.write(config_reference())
mkdocs_gen_files.set_edit_path("reference/config.md", "../solrl/config.py")

with mkdocs_gen_files.open("reference/cli.md", "w") as f:
    f.write(cli_reference())
mkdocs_gen_files.set_edit_path("reference/cli.md", "../solrl/cli.py")

shipped = [load_config(preset) for preset in list_presets()]  # read once, for every family's page
for family, twin, module in families():
    with mkdocs_gen_files.open(f"models/families/{family}.md", "w") as f:
        f.write(family_page(family, twin, module, shipped))

for path in sorted((REPO / "bench" / "results").rglob("*")):
    if path.suffix in (".md", ".png", ".csv", ".json") and path.is_file():
        with mkdocs_gen_files.open(f"development/results/{path.relative_to(REPO / 'bench' / 'results')}", "wb") as f:
            f.write(path.read_bytes())
