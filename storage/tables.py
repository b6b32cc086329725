"""Parquet tables (pyarrow): rewards, selections, metrics. Plain Arrow, readable by pandas, polars, DuckDB."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq


def write_table(path: Path, frame: pd.DataFrame) -> None:
    """Write ``frame`` (no index) as a Parquet file."""
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), path)


def read_table(path: Path) -> pd.DataFrame:
    return pq.read_table(path).to_pandas()
