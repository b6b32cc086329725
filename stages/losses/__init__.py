"""Policy losses."""
