-- Runs once, on the first start of an empty PostgreSQL volume: POSTGRES_DB (prefect) exists by then; MLflow's
-- tracking store gets its own database, owned by the same role (POSTGRES_USER).
CREATE DATABASE mlflow;
