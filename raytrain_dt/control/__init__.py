"""Control plane: the driver's coordinator, its elastic policy and recovery, the rank group of
Ray actors, and the run's set-up. It starts the ranks but never runs the distributed runtime
(engines, parallel plans, collective backends) itself: `pyproject.toml`'s import contracts."""
