"""Videos among the metrics: frame-to-frame change (the temporal guard) and frame strips for pictures.

A per-frame reward can be gamed with flicker: frames that each score well but do not make a coherent video.
``temporal_change`` measures it as the mean absolute pixel difference between consecutive frames; the
evaluation reports it and the temporal guard compares it with the starting policy's (``solrl.stages.guards``).
"""

from __future__ import annotations

import numpy as np

#: Frames shown per video in a picture (evenly spaced, first and last included).
STRIP_FRAMES = 4


def temporal_change(videos: np.ndarray) -> np.ndarray:
    """Mean absolute difference between consecutive frames of each video, in [0, 1] pixel units.

    Args:
        videos: uint8 ``[B, F, H, W, 3]``, ``F >= 2``.

    Returns:
        float32 ``[B]``: 0 for a still video, about 0.33 between independent uniform-noise frames.

    Raises:
        ValueError: not ``[B, F, H, W, 3]`` with at least two frames.
    """
    if videos.ndim != 5 or videos.shape[1] < 2:
        raise ValueError(f"temporal_change needs videos [B, F >= 2, H, W, 3], got {videos.shape}")
    x = videos.astype(np.float32) / 255.0
    return np.abs(np.diff(x, axis=1)).mean(axis=(1, 2, 3, 4)).astype(np.float32)


def frame_strip(videos: np.ndarray, frames: int = STRIP_FRAMES, gap: int = 1) -> np.ndarray:
    """Each video as one image: ``frames`` evenly spaced frames side by side, ``gap`` white columns between them
    (so the frames read as frames).

    Args:
        videos: uint8 ``[..., F, H, W, 3]``.

    Returns:
        uint8 ``[..., H, k W + (k - 1) gap, 3]`` with ``k = min(frames, F)``.
    """
    F = videos.shape[-4]
    picks = np.unique(np.linspace(0, F - 1, min(frames, F)).round().astype(int))
    separator = np.full((*videos.shape[:-4], videos.shape[-3], gap, 3), 255, dtype=videos.dtype)
    parts = []
    for i, f in enumerate(picks):
        parts += [separator] if i else []
        parts.append(videos[..., f, :, :, :])
    return np.concatenate(parts, axis=-2)
