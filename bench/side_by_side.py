"""Evaluation grids side by side in one PNG, each under its title (before/after figures of bench results).

    .venv/bin/python bench/side_by_side.py --out bench/results/defences/demo-grids.png \
        "start=runs/<old>/iter_000000/evaluate/samples.png" \
        "old default, iteration 20=runs/<old>/iter_000020/evaluate/samples.png" \
        "new default, iteration 20=runs/<new>/iter_000020/evaluate/samples.png"
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("panels", nargs="+", metavar="TITLE=PNG")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [panel.split("=", 1) for panel in args.panels]
    if any(len(panel) != 2 for panel in panels):
        parser.error("each panel is TITLE=PNG")
    images = [plt.imread(path) for _, path in panels]
    height, width = images[0].shape[:2]
    fig, axes = plt.subplots(1, len(images), figsize=(len(images) * width / 100, height / 100 + 0.5), squeeze=False)
    for ax, (title, _), image in zip(axes[0], panels, images, strict=True):
        ax.imshow(image)
        ax.set_title(title, fontsize=11)
        ax.axis("off")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
