"""Video families (issue 19): frames in the stores' dimensions, image rewards through frames, the temporal guard's
measure and alarm, frame strips in pictures, and the frame-count rule, each on values worked by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from solrl.config import ConfigError, load_config
from solrl.stages.context import StageContext
from solrl.stages.guards import evaluation_alarms
from solrl.stages.metrics.grid_artifacts import grid_energy
from solrl.stages.metrics.video import frame_strip, temporal_change
from solrl.stages.score import score_images
from solrl.storage.artifacts import CandidatePool, with_frames


def test_temporal_change_is_the_mean_absolute_difference_of_consecutive_frames():
    video = np.zeros((1, 3, 2, 2, 3), dtype=np.uint8)
    video[0, 1:] = 51  # frame 0 black, frames 1 and 2 at 51/255 = 0.2: changes 0.2 then 0
    np.testing.assert_allclose(temporal_change(video), [0.1], rtol=1e-6)
    with pytest.raises(ValueError, match="F >= 2"):
        temporal_change(video[:, :1])


def test_a_frame_strip_shows_evenly_spaced_frames_side_by_side():
    videos = np.zeros((2, 5, 1, 1, 3), dtype=np.uint8)
    videos[:, :, 0, 0, 0] = np.arange(5) * 10  # frame f has red 10 f
    strip = frame_strip(videos)
    assert strip.shape == (2, 1, 7, 3)  # 4 frames and 3 white gaps
    assert strip[0, 0, :, 0].tolist() == [0, 255, 10, 255, 30, 255, 40]  # linspace(0, 4, 4) rounded: 0, 1, 3, 4


def test_a_videos_grid_energy_is_the_mean_of_its_frames():
    rng = np.random.default_rng(0)
    videos = rng.integers(0, 256, (2, 3, 8, 8, 3), dtype=np.uint8)
    per_frame = grid_energy(videos.reshape(6, 8, 8, 3), 2).reshape(2, 3)
    np.testing.assert_allclose(grid_energy(videos, 2), per_frame.mean(1), rtol=1e-6)


def test_video_arrays_get_a_frame_dimension_in_the_stores(tmp_path: Path):
    assert with_frames(("prompt", "candidate", "y", "x", "rgb"), 6) == ("prompt", "candidate", "frame", "y", "x", "rgb")
    latent = ("prompt", "slot", "latent_channel", "latent_y", "latent_x")
    assert with_frames(latent, 6) == ("prompt", "slot", "latent_channel", "latent_frame", "latent_y", "latent_x")
    assert with_frames(("prompt", "candidate"), 2) == ("prompt", "candidate")
    pool = CandidatePool(
        images=np.zeros((1, 2, 5, 4, 4, 3), dtype=np.uint8),
        seeds=np.zeros((1, 2), dtype=np.int64),
        prompt_index=np.zeros(1, dtype=np.int64),
        attrs={"prompts": ["a"]},
    )
    pool.write(tmp_path)
    import xarray

    dataset = xarray.open_zarr(tmp_path / CandidatePool.filename)
    assert dataset["images"].dims == ("prompt", "candidate", "frame", "y", "x", "rgb")
    assert dataset["images"].encoding["chunks"] == (1, 1, 5, 4, 4, 3)  # one video per chunk
    assert CandidatePool.read(tmp_path / CandidatePool.filename).images.shape == (1, 2, 5, 4, 4, 3)


@pytest.mark.parametrize("how", ["mean", "min"])
def test_an_image_reward_scores_a_video_through_every_strided_frame(tmp_path: Path, how: str):
    cfg = load_config(
        "tiny-digits",
        [
            f"storage.root={tmp_path}",
            "reward.weights={jpeg_compressibility: 1.0}",
            f"reward.video={how}",
            "reward.frame_stride=2",
        ],
    )
    ctx = StageContext(cfg, tmp_path, "r", 1)
    rng = np.random.default_rng(0)
    videos = rng.integers(0, 256, (2, 5, 16, 16, 3), dtype=np.uint8)
    videos[1, 2] = 128  # a flat frame compresses far better than noise: it sets video 1's max
    names = {"jpeg_compressibility": 1.0}
    frames = videos[:, [0, 2, 4]]  # stride 2: frames 0, 2, 4
    per_frame = score_images(ctx, frames.reshape(6, 16, 16, 3), ["a photo"] * 6, names)["jpeg_compressibility"].values
    expected = getattr(per_frame.reshape(2, 3), how)(1)
    got = score_images(ctx, videos, ["a photo", "a photo"], names)["jpeg_compressibility"].values
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert got.shape == (2,) and got.dtype == np.float32


def test_the_temporal_guard_alarms_above_its_factor_of_the_start(tmp_path: Path):
    bounds = load_config("tiny-digits", [f"storage.root={tmp_path}"]).campaign  # guard_temporal_factor 1.5
    start = {"eval/temporal_change": 0.05}
    assert evaluation_alarms({"eval/temporal_change": 0.07}, start, 3, bounds) == []
    (alarm,) = evaluation_alarms({"eval/temporal_change": 0.08}, start, 3, bounds)
    assert (alarm.measure, alarm.iteration, alarm.value) == ("temporal", 3, 0.08)
    assert alarm.bound == pytest.approx(0.075)
    assert "1.6x the starting policy's 0.0500" in alarm.message and "flicker" in alarm.message


def test_a_video_family_refuses_a_frame_count_its_vae_cannot_encode(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"4k \+ 1 frames.*e\.g\. 5 or 9"):
        load_config("tiny-wan", [f"storage.root={tmp_path}", "model.num_frames=6"])
    assert load_config("tiny-wan", [f"storage.root={tmp_path}", "model.num_frames=9"]).model.num_frames == 9


@pytest.mark.parametrize(
    ("preset", "override", "message"),
    [
        ("tiny-flux", "model.num_frames=5", "tiny-flux is an image family; model.num_frames is for video families"),
        ("tiny-digits", "model.num_frames=5", "tiny-digits is an image family"),
        ("tiny-wan", "reward.frame_stride=99", "reward.frame_stride=99 with model.num_frames=5 scores the first frame"),
    ],
)
def test_frame_settings_that_would_be_ignored_are_refused(tmp_path: Path, preset: str, override: str, message: str):
    with pytest.raises(ConfigError, match=message):
        load_config(preset, [f"storage.root={tmp_path}", override])
