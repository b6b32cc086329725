"""Zarr stores for candidate pools and regenerated samples (zarr-python 3).

Every array of a pool shares the leading prompt axis ``P``; chunks are one
prompt each along it, so a shard of prompts can write its own region.
Stores open with zarr-python and xarray.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import zarr


def write_arrays(path: Path, arrays: dict[str, np.ndarray], attrs: dict[str, Any] | None = None) -> None:
    """Write ``arrays`` (name -> ndarray, each with leading axis P) as one Zarr group at ``path``.

    Raises:
        ValueError: the arrays disagree on the leading axis.
    """
    lead = {a.shape[0] for a in arrays.values()}
    if len(lead) > 1:
        raise ValueError(f"arrays disagree on the prompt axis: { {k: v.shape for k, v in arrays.items()} }")
    group = zarr.open_group(str(path), mode="w-")
    for name, data in arrays.items():
        data = np.ascontiguousarray(data)
        chunks = (1, *data.shape[1:]) if data.ndim > 1 else data.shape
        array = group.create_array(name, shape=data.shape, dtype=data.dtype, chunks=chunks)
        array[...] = data
    group.attrs.update(attrs or {})


def read_arrays(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read every array of the Zarr group at ``path`` and its attributes."""
    group = zarr.open_group(str(path), mode="r")
    return {name: np.asarray(array[...]) for name, array in group.arrays()}, dict(group.attrs)
