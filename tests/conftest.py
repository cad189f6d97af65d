"""Test-wide settings: tests run on CPU with tiny models; one thread keeps them predictable."""

import os

import torch

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
torch.set_num_threads(1)
