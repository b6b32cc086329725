"""One self-contained HTML page per run (``solrl report RUN_ID --html OUT.html``), from its committed files.

The page holds, as inline PNGs: the training reward (explore pool and BF16 regenerated samples) and every
evaluation reward over iterations; proxy fidelity (kept-seed rank agreement) and the full-pool audits; sample
diversity, the grid-artifact energy and, for videos, the temporal change; the seconds of each stage per
iteration; each iteration's best/worst grid and the latest evaluation samples; then the config. A run that died
mid-iteration shows what exists and lists the stages not committed. The campaign flow logs the same figures to
MLflow (``report/``).

A small script in the page records, once loaded, how many of its figures decoded
(``<body data-figures-rendered="N" data-figures="M">``) and where each one landed (``data-geometry``: a JSON
list of rectangles in CSS pixels), so a headless browser can check the page and its layout.
"""

from __future__ import annotations

import base64
import html
import io
import re
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import yaml

from solrl.storage.artifacts import EvalSamples, FidelityTable, Selection
from solrl.storage.report import collect_metrics
from solrl.storage.runs import Run, solrl_command
from solrl.storage.stage import output_dir, read_manifest

#: (title, metric prefixes or names) of the curve figures, in page order.
CURVES = (
    ("Training reward", ("explore/reward_mean", "regenerate/reward_mean", "regenerate/reward_max")),
    ("Evaluation rewards (held-out prompts, fixed seeds)", ("eval/",)),
    ("Proxy fidelity (explore vs BF16 ranking of the kept seeds)", ("fidelity/",)),
    ("Full-pool audits (whole pools regenerated in BF16)", ("audit/",)),
    (
        "Guards: sample diversity, grid-artifact energy and (videos) temporal change",
        ("eval/diversity", "eval/grid_energy", "eval/temporal_change"),
    ),
)
_GUARDS = ("eval/diversity", "eval/grid_energy", "eval/temporal_change")


def _anchor(title: str) -> str:
    """A section's id, so a link can point into the page (``report.html#kept``): ``Proxy fidelity (...)`` ->
    ``proxy-fidelity``."""
    return re.sub(r"[^a-z0-9]+", "-", title.split("(")[0].split(":")[0].lower()).strip("-")


def _columns(frame: pd.DataFrame, wanted: Sequence[str]) -> list[str]:
    found = []
    for want in wanted:
        matches = [c for c in frame.columns if c == want or (want.endswith("/") and c.startswith(want))]
        found += [c for c in matches if c not in found]
    return found


def _place(title: str) -> int:
    """Where the section ``title`` goes among the curve figures: their order in ``CURVES``, the stage-time split
    last."""
    titles = [t for t, _ in CURVES]
    return titles.index(title) if title in titles else len(titles)


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return base64.b64encode(buf.getvalue()).decode()


#: Charts per row of a section's grid, and the figure width in inches (at 100 dpi: 1200 px, the page's width).
_COLUMNS, _WIDTH = 3, 12.0


def _axes_style(ax, title: str, iterations: pd.Series) -> None:
    """Integer iteration ticks over the run's whole range (a measure logged once still sits on its iteration),
    plain tick labels (no offset such as ``1e-5 + 9.999e-1``), a light grid."""
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    ax.set_title(title, fontsize=10)
    ax.set_xlabel("iteration")
    ax.set_xlim(float(iterations.min()) - 0.5, float(iterations.max()) + 0.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    formatter = ScalarFormatter(useOffset=False)
    formatter.set_scientific(False)
    ax.yaxis.set_major_formatter(formatter)
    ax.grid(alpha=0.3)


def curve_figures(frame: pd.DataFrame) -> list[tuple[str, str]]:
    """``(title, base64 PNG)`` of each curve figure that has data, and the stage-time split.

    Each figure is a labelled grid of one chart per measure, ``_COLUMNS`` to a row, 1200 px wide."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    for title, wanted in CURVES:
        columns = _columns(frame, wanted)
        if title.startswith("Evaluation"):
            columns = [c for c in columns if c not in _GUARDS]
        columns = [c for c in columns if frame[c].notna().any()]
        if not columns:
            continue
        rows = -(-len(columns) // _COLUMNS)
        fig, axes = plt.subplots(rows, _COLUMNS, figsize=(_WIDTH, 3.0 * rows), squeeze=False, layout="constrained")
        for ax, column in zip(axes.flat, columns):
            data = frame[["iteration", column]].dropna()
            ax.plot(data["iteration"], data[column], marker="o", ms=3)
            _axes_style(ax, column, frame["iteration"])
        for ax in list(axes.flat)[len(columns) :]:
            ax.set_visible(False)
        figures.append((title, _png(fig)))
        plt.close(fig)
    seconds = frame.filter(like="seconds/").fillna(0)
    if not seconds.empty:
        fig, ax = plt.subplots(figsize=(_WIDTH, 3.6), layout="constrained")
        bottom = None
        for column in seconds.columns:
            ax.bar(frame["iteration"], seconds[column], bottom=bottom, label=column.removeprefix("seconds/"))
            bottom = seconds[column] if bottom is None else bottom + seconds[column]
        _axes_style(ax, "seconds per stage", frame["iteration"])
        ax.set_ylabel("seconds")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # outside the bars
        figures.append(("Stage-time split", _png(fig)))
        plt.close(fig)
    return figures


#: The page's style: charts at the page's width; image grids at their pixel size or scaled up crisply, two a row.
_CSS = (
    "body{font-family:sans-serif;margin:1.5em auto;max-width:1240px;padding:0 1em}"
    "img{display:block;margin:.5em 0}img.chart{width:100%;height:auto}"
    "img.grid{max-width:100%;min-width:300px;image-rendering:pixelated}"
    ".grids,.pair{display:grid;grid-template-columns:repeat(auto-fit,minmax(420px,1fr));gap:1em}"
    "figure{margin:0;min-width:0}figcaption{font-weight:bold;margin:.3em 0}"
    "pre{background:#f5f5f5;padding:1em;overflow:auto}table{border-collapse:collapse}"
    "td,th{border:1px solid #ccc;padding:2px 6px;font-size:90%}"
)


def _image(path: Path) -> str | None:
    return base64.b64encode(path.read_bytes()).decode() if path.is_file() else None


def render_html(
    run: Run,
    stages: Sequence[str],
    plan: Sequence[tuple[int, Sequence[str]]],
    figures: list[tuple[str, str]] | None = None,
) -> str:
    """The report page of ``run`` (module doc). ``stages``: the iteration's stage names in order; ``plan``: the
    campaign plan, to list what is not committed; ``figures``: ``curve_figures`` when already drawn."""
    frame = collect_metrics(run.run_dir, tuple(stages))
    if figures is None:
        figures = curve_figures(frame) if not frame.empty else []
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>solrl run {html.escape(run.run_id)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>solrl run {html.escape(run.run_id)}</h1>",
        f"<p>{html.escape(run.config.name)}: model {html.escape(run.config.model.family)}, explore "
        f"{html.escape(run.config.explore.precision)} pool {run.config.explore.pool_size} -> keep "
        f"{run.config.select.k}, loss {html.escape(run.config.train.loss)}, "
        f"{run.config.campaign.iterations} iterations. Store: <code>{html.escape(str(run.run_dir))}</code></p>",
    ]
    pending = [
        f"iteration {i}: {', '.join(s for s in names if read_manifest(run.run_dir, i, s) is None)}"
        for i, names in plan
        if any(read_manifest(run.run_dir, i, s) is None for s in names)
    ]
    if pending:
        shown = pending[:3] + ([f"... and {len(pending) - 3} more iterations"] if len(pending) > 3 else [])
        parts.append(
            "<p><b>Not committed yet</b> (the run is running, died, or was stopped; "
            f"<code>solrl resume {html.escape(run.run_id)}</code> continues it): "
            + "; ".join(html.escape(p) for p in shown)
            + "</p>"
        )
    if frame.empty:
        parts.append("<p>No stage is committed yet.</p>")
    else:
        sections = [
            (
                _place(title),
                f"<h2 id='{_anchor(title)}'>{html.escape(title)}</h2><img class='chart' "
                f"alt='{html.escape(title)}' src='data:image/png;base64,{png}'>",
            )
            for title, png in figures
        ]
        if not run.config.regenerate.enabled:  # where the fidelity figure would be, say why there is none
            title = CURVES[2][0]
            sections.append(
                (
                    _place(title),
                    f"<h2 id='{_anchor(title)}'>{html.escape(title)}</h2>"
                    f"<p>Not measured: {html.escape(FidelityTable.not_measured)}.</p>",
                )
            )
        parts += [section for _, section in sorted(sections, key=lambda s: s[0])]
    grids, failed = [], []
    for i, _ in plan:  # an image is embedded only when its stage's checksums hold
        if read_manifest(run.run_dir, i, "select") is None:
            continue
        if read_manifest(run.run_dir, i, "select", verify=True) is None:
            failed.append(f"iteration {i}: select")
            continue
        png = _image(output_dir(run.run_dir, i, "select") / Selection.grid)
        if png is not None:
            grids.append(
                f"<figure><figcaption>iteration {i}</figcaption><img class='grid' "
                f"alt='best and worst, iteration {i}' src='data:image/png;base64,{png}'></figure>"
            )
    if grids:
        parts.append(
            "<h2 id='kept'>Best (left) and worst kept candidates per iteration</h2><p>Explore reward under each "
            "image; the red rule parts the kept best from the kept worst.</p><div class='grids'>"
            + "".join(grids)
            + "</div>"
        )
    evaluated = [i for i, _ in plan if read_manifest(run.run_dir, i, "evaluate") is not None]
    shown = []
    for i in dict.fromkeys([evaluated[0], evaluated[-1]] if evaluated else []):
        if read_manifest(run.run_dir, i, "evaluate", verify=True) is None:
            failed.append(f"iteration {i}: evaluate")
        elif (png := _image(output_dir(run.run_dir, i, "evaluate") / EvalSamples.grid)) is not None:
            label = "starting policy" if i == 0 else f"iteration {i}"
            shown.append(
                f"<figure><figcaption>Evaluation samples, {label}</figcaption><img class='grid' "
                f"alt='evaluation, {label}' src='data:image/png;base64,{png}'></figure>"
            )
    if shown:  # the starting and the latest policy side by side, same prompts and seeds in the same places
        heading = "<h2 id='evaluation-samples'>Evaluation samples</h2>"
        parts.append(heading + "<div class='pair'>" + "".join(shown) + "</div>")
    if failed:
        parts.append(
            "<p><b>Not shown, failing verification</b> (a file changed since it was committed; <code>"
            f"{html.escape(solrl_command('verify', run.run_id, '--store', run.store, '--redo'))}</code> uncommits "
            f"them and <code>solrl resume</code> recomputes them): {html.escape('; '.join(failed))}</p>"
        )
    config = yaml.safe_dump(run.config.model_dump(mode="json"), sort_keys=False)
    parts.append(f"<h2 id='config'>Config</h2><pre>{html.escape(config)}</pre>")
    parts.append(
        "<script>window.addEventListener('load',()=>{const i=[...document.images];"
        "document.body.dataset.figures=i.length;"
        "document.body.dataset.figuresRendered=i.filter(x=>x.complete&&x.naturalWidth>0).length;"
        "document.body.dataset.geometry=JSON.stringify(i.map(x=>{const r=x.getBoundingClientRect();"
        "return {alt:x.alt,left:r.left,top:r.top+scrollY,width:r.width,height:r.height,natural:x.naturalWidth};}));"
        "document.body.dataset.window=innerWidth;});</script>"
    )
    parts.append("</body></html>")
    return "\n".join(parts)


#: The run store's copy of the report: ``<run>/report/report.html`` and its figures (the campaign rewrites it).
REPORT_DIR = "report"


def write_report(run: Run, stages: Sequence[str], plan: Sequence[tuple[int, Sequence[str]]], out: Path) -> list[Path]:
    """Write each curve figure as its own PNG into the folder ``out``, then ``report.html`` (what the campaign
    flow logs to MLflow), each whole or not at all (a full disk or a crash leaves the earlier file): a page there
    was written after its figures. Returns the paths written, the page first."""
    from solrl.storage.stage import replaced_atomically

    out.mkdir(parents=True, exist_ok=True)
    frame = collect_metrics(run.run_dir, tuple(stages))
    figures = curve_figures(frame) if not frame.empty else []
    written = []
    for title, png in figures:
        path = out / ("".join(ch if ch.isalnum() else "_" for ch in title.lower()).strip("_")[:60] + ".png")
        with replaced_atomically(path) as tmp:
            tmp.write_bytes(base64.b64decode(png))
        written.append(path)
    page = out / "report.html"
    with replaced_atomically(page) as tmp:
        tmp.write_text(render_html(run, stages, plan, figures), encoding="utf-8")
    return [page, *written]
