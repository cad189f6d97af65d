"""Runs the `opd` CLI and SIGKILLs it at its N-th durable write.

usage: python -m tests.faults.killer N mid|after -- OPD ARGS...
Writes are counted in the order `inject.instrument` sees them (shards, checkpoints, commits).
"""

import sys

import pytest
import torch

from cli.main import main
from tests.faults.inject import instrument

if __name__ == "__main__":
    n, phase = int(sys.argv[1]), sys.argv[2]
    args = sys.argv[sys.argv.index("--") + 1 :]
    torch.set_num_threads(1)  # as in-process tests run, so shards match to the byte
    seen = 0

    def hook(label: str) -> str | None:
        global seen
        seen += 1
        return phase if seen == n else None

    instrument(pytest.MonkeyPatch(), hook)
    sys.argv = ["opd", *args]
    main()
