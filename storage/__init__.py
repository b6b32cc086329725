"""Run layout, Zarr pools, Parquet tables, manifests, checkpoints and tracking."""
