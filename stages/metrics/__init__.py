"""Metrics over stored outputs: seed selection, proxy fidelity, diversity, image grids."""
