"""Prefect flows: thin wiring of the stages (no math, no tensors, no file formats)."""
