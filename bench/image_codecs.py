"""Lossless codecs for a pool's uint8 images (issue 36): size and speed on real photographs.

The images: scikit-learn's two bundled sample photographs (``load_sample_images``: china.jpg and flower.jpg, 427 x
640, shipped with scikit-learn, a dependency), cropped at their own resolution, and a
tiny-digits pool of 32 candidates (16 x 16). Each codec is Zarr's own (``zarr.codecs``) where Zarr has it, written
and read back through a Zarr array chunked as the pool is (one candidate per chunk); PNG (Pillow, level 6) is the
PNG-class reference, one image per file. Prints the ratio (raw / stored), and write and read MB/s of raw pixels.

    .venv/bin/python bench/image_codecs.py
"""

from __future__ import annotations

import solrl  # noqa: F401  (first: solrl sets the OpenMP spin policy before torch loads)

# isort: split

import io
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import zarr
from PIL import Image
from sklearn.datasets import load_sample_images
from zarr.codecs import BloscCodec, ZstdCodec

from solrl.storage.artifacts import chunk_shape


def photographs(count: int = 8) -> np.ndarray:
    """uint8 ``[count, 400, 600, 3]``: crops of the two sample photographs at their own resolution, shifted so no
    two are equal (tiling or upsampling them would hand the codecs repeats and smoothness real samples lack)."""
    images = load_sample_images().images
    return np.stack([images[i % 2][i : i + 400, i : i + 600] for i in range(count)])


def tiny_digits_pool() -> np.ndarray:
    """uint8 ``[32, 16, 16, 3]``: one tiny-digits prompt's pool, sampled by the shipped model."""
    from solrl.config import load_config
    from solrl.stages.context import StageContext
    from solrl.stages.pipeline import run_stage
    from solrl.storage.artifacts import CandidatePool
    from solrl.storage.runs import create_run

    root = tempfile.mkdtemp(prefix="solrl-codecs-")
    cfg = load_config("tiny-digits", ["campaign.prompts_per_iteration=1", f"storage.root={root}"])
    run = create_run(cfg, "codecs")
    run_stage(StageContext.of(run, 1), "explore")
    return np.asarray(CandidatePool.load(run.run_dir, 1).images)[0]


def through_zarr(images: np.ndarray, compressors: list) -> tuple[float, float, float]:
    """(ratio, write MB/s, read MB/s) of ``images`` ``[N, H, W, 3]`` as one Zarr array, one prompt of them."""
    data = images[None]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "pool.zarr"
        start = time.perf_counter()
        array = zarr.create_array(
            str(path),
            shape=data.shape,
            dtype=data.dtype,
            chunks=chunk_shape(data.shape, 1, ("prompt", "candidate", "y", "x", "rgb")),
            compressors=compressors,
        )
        array[...] = data
        written = time.perf_counter() - start
        stored = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        start = time.perf_counter()
        back = zarr.open_array(str(path), mode="r")[...]
        read = time.perf_counter() - start
    assert np.array_equal(back, data)
    return data.nbytes / stored, data.nbytes / written / 1e6, data.nbytes / read / 1e6


def through_png(images: np.ndarray) -> tuple[float, float, float]:
    start = time.perf_counter()
    blobs = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG", compress_level=6)
        blobs.append(buffer.getvalue())
    written = time.perf_counter() - start
    start = time.perf_counter()
    back = np.stack([np.asarray(Image.open(io.BytesIO(b))) for b in blobs])
    read = time.perf_counter() - start
    assert np.array_equal(back, images)
    return images.nbytes / sum(map(len, blobs)), images.nbytes / written / 1e6, images.nbytes / read / 1e6


CODECS = {
    "none (raw)": [],
    "zstd 0 (Zarr's default)": [ZstdCodec(level=0)],
    "zstd 1": [ZstdCodec(level=1)],
    "zstd 3": [ZstdCodec(level=3)],
    "zstd 9": [ZstdCodec(level=9)],
    "blosc zstd 3, bitshuffle": [BloscCodec(cname="zstd", clevel=3, shuffle="bitshuffle")],
    "blosc lz4 5, shuffle": [BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")],
}


def main() -> None:
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, zarr {zarr.__version__}, {time.strftime('%Y-%m-%d')}\n"
    )
    for title, images in (
        ("8 photographs, 400 x 600 crops (sklearn's china.jpg and flower.jpg)", photographs()),
        ("a tiny-digits pool: 32 candidates at 16 x 16", tiny_digits_pool()),
    ):
        print(f"### {title}\n")
        print("| codec | ratio | write MB/s | read MB/s |")
        print("| --- | --- | --- | --- |")
        for name, compressors in CODECS.items():
            ratio, write, read = through_zarr(images, compressors)
            print(f"| {name} | {ratio:.2f} | {write:.0f} | {read:.0f} |")
        ratio, write, read = through_png(images)
        print(
            f"| PNG level 6 (Pillow; one file per image, not a Zarr codec) | {ratio:.2f} | {write:.0f} | {read:.0f} |\n"
        )


if __name__ == "__main__":
    main()
