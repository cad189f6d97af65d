"""Prefect wiring only: flows, tasks, deployments. No tensors, no stage logic."""
