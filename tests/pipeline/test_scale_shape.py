"""Every stage at a real model's vocabulary: `opd run full --profile tiny` on a synthetic target
of Llama-3.1-8B's shape (`target.path=shape:llama-3.1-8b`, 128,256-token vocabulary, the real
heads-to-KV-heads ratio, head_dim, rope and untied head), at reduced depth and width.

Depth 4: the fewest layers EAGLE-3's three aux ids (1, 2, 3: strictly increasing, >= 1) fit.
Width 512 (4 query heads / 1 KV head of 128, MLP 1,792), not 4,096: at full width 4 layers are
1.9B fp32 parameters (7.7 GB) before the drafter's weights and Adam state (another ~7.6 GB for a
width-4096 EAGLE-3 layer with a 32k head), past what CI's memory holds; 512 is the narrowest
width the shape keeps its head size and KV grouping at. Every stage runs once (one round, 3 sft
and 2 opd steps): the test took 42 s on an idle 2-core machine (89 s with the tiny profile's
two rounds and full step counts, which check nothing more about the shape), peak RSS under
2.5 GB. The vocabulary is the real one throughout: prompts tokenize to ids below 4,096 (the
embedded BPE), the random target generates ids up to 128,255, and the draft vocabulary is
Llama-3.1-8B EAGLE-3's 32,000.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.compute as pc
import pytest
from safetensors import safe_open

from storage import Store

pytestmark = pytest.mark.slow  # minutes: scheduled early by tests/conftest.py

VOCAB = 128_256
WIDTH = 512
DRAFT_VOCAB = 32_000
SETS = [
    "target.device=cpu",
    "target.path=shape:llama-3.1-8b",
    "target.shape.num_layers=4",
    f"target.shape.hidden_size={WIDTH}",
    f"features.draft_vocab_size={DRAFT_VOCAB}",
    # Every stage once is what the shape needs: one round, and the fewest steps and prompts
    # that still run each stage's every path (a validation pass, a rollout with rejections).
    "rounds=1",
    "sft.steps=3",
    "opd.steps=2",
    "rollout.max_prompts=6",
    "evaluate.max_prompts=2",
]
PEAK_RSS_BOUND = 7 << 29
"""The run's peak resident memory (measured 2.2 GB alone; 3.1 GB once in a full `make test` run
since the chain ends by tuning K and evaluating again): the target (0.6 GB fp32, most of it the
two 128k x 512 embeddings), the drafter, its Adam state and the teacher's logits blocks."""


def _run(root: Path, log: Path) -> tuple[int, int]:
    """(exit code, peak RSS in bytes) of `opd run full` in a fresh process."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPD_HOME": str(root)}
    sets = [a for s in SETS for a in ("--set", s)]
    cmd = [sys.executable, "-m", "cli.main", "run", "full", "--profile", "tiny", "--no-progress"]
    with log.open("w") as out:
        proc = subprocess.Popen([*cmd, *sets], env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss * 1024  # ru_maxrss is in KiB on Linux


def _tensors(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118


def test_run_full_on_a_llama_3_1_8b_shaped_target_at_reduced_depth(tmp_path: Path):
    code, peak = _run(tmp_path, tmp_path / "run.log")
    assert code == 0, (tmp_path / "run.log").read_text()[-3000:]
    assert peak < PEAK_RSS_BOUND, f"peak RSS {peak / 2**30:.2f} GiB"
    store = Store(tmp_path)
    runs = sorted((tmp_path / "_runs").glob("*.json"))
    made = json.loads(runs[-1].read_text())["datasets"]
    ds = {step: store.open(made[step]) for step in made}

    prompts = ds["prompts"].read_table()
    assert prompts.num_rows > 0 and pc.max(pc.list_flatten(prompts["prompt_ids"])).as_py() < 4096

    trajectories = ds["generate"].read_table()
    generated = pc.list_flatten(trajectories["input_ids"])
    assert pc.max(generated).as_py() < VOCAB
    assert pc.max(generated).as_py() >= 4096  # the synthetic ids past the BPE are generated

    features = ds["features"]
    assert features.meta["hidden_size"] == WIDTH
    assert features.meta["target"]["vocab_size"] == VOCAB
    vocab = _tensors(features.file("draft_vocab.safetensors"))
    assert vocab == {"d2t": (DRAFT_VOCAB,), "t2d": (VOCAB,), "counts": (VOCAB,)}

    for step in ("sft", "opd-r1"):
        weights = _tensors(ds[step].file("model.safetensors"))
        heads = [shape for name, shape in weights.items() if name.endswith("lm_head.weight")]
        assert heads == [(DRAFT_VOCAB, WIDTH)], (step, heads)
    assert ds["rollout-r1"].num_rows > 0 and ds["score-r1"].num_rows > 0
    assert ds["evaluate"].meta["tau"] >= 1.0

    (export,) = (tmp_path / "_exports").iterdir()
    native = _tensors(export / "eagle3" / "model.safetensors")
    assert native["d2t"] == (DRAFT_VOCAB,) and native["t2d"] == (VOCAB,)
    assert native["lm_head.weight"] == (DRAFT_VOCAB, WIDTH)
    speculators = _tensors(export / "speculators" / "model.safetensors")
    assert speculators["embed_tokens.weight"] == (VOCAB, WIDTH)
    config = json.loads((export / "eagle3" / "config.json").read_text())
    assert config["vocab_size"] == VOCAB and config["draft_vocab_size"] == DRAFT_VOCAB
    # the target's long-context rope, not a short default (a drafter that loads, accepts nothing)
    assert config["max_position_embeddings"] == 131_072
    assert config["rope_parameters"]["rope_type"] == "llama3"


TEACHER_PROBE = textwrap.dedent(
    """
    import resource, sys, torch
    from models.teacher import teacher_logits
    rows, vocab, width, draft = 4096, 128256, 64, 4096
    torch.manual_seed(0)
    head, hidden = torch.randn(vocab, width), torch.randn(rows, width)
    ids = torch.randperm(vocab)[:draft].sort().values
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    teacher = teacher_logits(hidden, head, ids, [0.5])
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((after - before) * 1024, teacher.draft.numel() * 4)
    """
)


def test_the_teacher_at_a_128k_vocabulary_never_holds_the_full_logits(tmp_path: Path):
    """4,096 rows x 128,256 ids: the full fp32 logits are 2.1 GB (and a softmax as much again);
    the blocked teacher keeps 256 MiB blocks and the [rows, Vd] draft logits (67 MB)."""
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", TEACHER_PROBE], env=env, capture_output=True, text=True, check=True
    )
    growth, draft_bytes = map(int, done.stdout.split())
    full_logits = 4096 * VOCAB * 4
    # a block (256 MiB) and one temporary of its size for the logsumexp, plus the draft logits
    assert growth < 3 * (256 << 20) + draft_bytes < full_logits / 2, growth
