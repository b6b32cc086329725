"""Stage functions (no Prefect import) and the domain code they use."""
