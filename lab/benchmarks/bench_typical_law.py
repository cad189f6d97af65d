"""Typical acceptance vs the lossless rule against the target's law, on the embedded target at
T=1 (Medusa's claim: typical acceptance is lossy for any non-greedy policy).

At fixed prefixes, the first two emitted tokens are drawn `--draws` times under
  (a) plain sampling from the target,
  (b) the drafter proposing (`--shape`: a tree, or a chain), verified by the loop's lossless
      rule (rejection sampling: point-mass sibling tests on a tree, Leviathan's test on a chain),
  (c) the same proposals verified by Medusa's typical acceptance (models/verify.py, lossy),
and each empirical law is set against the target's exact one, computed by enumeration: the
first token's over the whole vocabulary, the first two tokens' over every continuation of the
`--top` likeliest first tokens (the rest pooled into one cell). Printed per prefix and mode:
Pearson's statistic with its 1e-6 critical value (cells expected below 5 pooled), and the total
variation distance of the empirical law from the exact one beside the claim's bound 1 - max p.
The decoding loop draws with max_new_tokens=3, so the second token is decided by verification
(an accepted head-1 candidate, or the residual / argmax after none), not by a plain sample.

The drafter: `--root R --drafter REF` (an `sft@...` dataset trained on the embedded target),
else one of `--kind` fitted here (`fit_drafter`: its SFT loss on the target's own samples from
the prefixes).

    .venv/bin/python -m lab.benchmarks.bench_typical_law --kind KIND [--root R --drafter sft@VERSION]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from torch import Tensor

from models.decoding import SpecConfig, speculative_generate, target_generate
from models.drafter import ChainShape, Shape, TreeShape
from models.drafters import KINDS, drafter_class
from models.features import Features
from models.target import Target, load_target
from models.verify import Typical
from models.vocab import DraftVocab

EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "tiny_target" / "model"
PREFIXES = ("def __init__(self, ", "import os\nimport ", "    for i in range(", "return self.")
MODES = ("plain", "rejection", "typical")
Z_1E6 = 4.753  # the standard normal's upper 1e-6 quantile
CHUNK = 1000


def prefix_ids(prefixes: tuple[str, ...] = PREFIXES) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED)
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prefixes]


@torch.no_grad()
def fit_drafter(
    target: Target,
    prompts: list[list[int]],
    kind: str,
    *,
    steps: int = 150,
    samples: int = 16,
    seed: int = 0,
):
    """A `kind` drafter (its default settings, over the target's 1,024 most used ids in its own
    samples) trained for 3 draft offsets with its SFT loss against the target on `samples`
    samples of 48 tokens per prompt."""
    sequences = []
    for i, prompt in enumerate(prompts):
        out = target_generate(target, [prompt] * samples, 48, temperature=1.0, seed=seed + i)
        sequences += [prompt + s for s in out.sequences]
    width = max(map(len, sequences))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])  # [N, T]
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences]).bool()
    counts = torch.bincount(ids[mask], minlength=target.vocab_size).float()
    vocab = DraftVocab.from_counts(counts, 1024)
    out = target.forward(ids)
    teacher = torch.softmax(out.logits[..., vocab.draft_to_target_ids], dim=-1)  # [N, T, Vd]
    features = Features(ids, out.aux_hidden, out.last_hidden)
    torch.manual_seed(seed)
    drafter = drafter_class(kind).new(target, vocab, {})
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    with torch.enable_grad():
        for _ in range(steps):
            unrolled = drafter.unroll(features, mask, 3)
            loss = drafter.sft_loss(unrolled, teacher, out.last_hidden, decay=0.8)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return drafter.eval()


@torch.no_grad()
def exact_law(target: Target, prompt: list[int], top: int) -> tuple[Tensor, Tensor, Tensor]:
    """The target's law at T=1 after `prompt`: p1 [V] of the first token, the `top` likeliest
    first tokens [M] and p2 [M, V], the second token's law after each."""
    p1 = torch.softmax(target.forward(torch.tensor([prompt])).logits[0, -1].double(), -1)
    firsts = p1.topk(top).indices  # [M]
    ids = torch.cat([torch.tensor(prompt).expand(top, -1), firsts[:, None]], dim=1)
    p2 = torch.softmax(target.forward(ids).logits[:, -1].double(), -1)  # [M, V]
    return p1, firsts, p2


def draw(target, drafter, prompt, n: int, mode: str, shape: Shape, seed: int) -> Tensor:
    """n draws [n, 2] of the first two tokens after `prompt` under `mode` (module docstring),
    in batches of `CHUNK` rows (a tree's verify logits are [rows, 1+N, V])."""
    out = []
    for start in range(0, n, CHUNK):
        rows, chunk_seed = [prompt] * min(CHUNK, n - start), seed + start
        if mode == "plain":
            res = target_generate(
                target, rows, 2, temperature=1.0, seed=chunk_seed, eos_token_ids=()
            )
        else:
            typical = Typical() if mode == "typical" else None
            cfg = SpecConfig(
                shape, 1.0, max_new_tokens=3, seed=chunk_seed, eos_token_ids=(), typical=typical
            )
            res = speculative_generate(target, drafter, rows, cfg)
        out += [s[:2] for s in res.sequences]
    return torch.tensor(out)


def pearson(counts: Tensor, expected: Tensor) -> tuple[float, float]:
    """Pearson's statistic of counts [C] against expected counts [C] (the last cell is the
    pooled rest), cells expected below 5 pooled into one; and its 1e-6 critical value
    (Wilson-Hilferty's approximation of the chi-square quantile)."""
    big = expected >= 5
    stat = float(((counts[big] - expected[big]) ** 2 / expected[big]).sum())
    small_e, small_c = float(expected[~big].sum()), float(counts[~big].sum())
    if small_e > 0:
        stat += (small_c - small_e) ** 2 / small_e
    elif small_c > 0:
        stat = math.inf  # draws where the target puts no mass at all
    df = max(int(big.sum()), 1)  # big cells + the pooled one - 1
    critical = df * (1 - 2 / (9 * df) + Z_1E6 * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


def law_report(draws: Tensor, p1: Tensor, firsts: Tensor, p2: Tensor) -> dict[str, float]:
    """χ² and TV of n draws [n, 2] against the exact law: first token, then the first two."""
    n, V = len(draws), len(p1)
    ones = torch.bincount(draws[:, 0], minlength=V).double()
    stat1, crit1 = pearson(ones, p1 * n)
    tv1 = 0.5 * float((ones / n - p1).abs().sum())
    # two tokens: (x1, x2) for the `top` likeliest x1, then one pooled cell for the rest
    rank = torch.full((V,), -1, dtype=torch.long)
    rank[firsts] = torch.arange(len(firsts))
    r = rank[draws[:, 0]]
    cell = torch.where(r >= 0, r * V + draws[:, 1], len(firsts) * V)
    twos = torch.bincount(cell, minlength=len(firsts) * V + 1).double()
    joint = (p1[firsts, None] * p2).reshape(-1)
    joint = torch.cat([joint, (1 - joint.sum()).clamp(min=0)[None]])
    stat2, crit2 = pearson(twos, joint * n)
    tv2 = 0.5 * float((twos / n - joint).abs().sum())  # a lower bound: the rest is one cell
    return {
        "chi2_first": stat1,
        "critical_first": crit1,
        "tv_first": tv1,
        "chi2_first_two": stat2,
        "critical_first_two": crit2,
        "tv_first_two": tv2,
    }


def measure(
    target: Target,
    drafter,
    prompts,
    *,
    n: int,
    shape: Shape,
    top: int = 64,
    seed: int = 0,
    modes: tuple[str, ...] = MODES,
) -> list[dict]:
    """One row per prefix: the bound 1 - max p and each of `modes`' `law_report`."""
    rows = []
    for i, prompt in enumerate(prompts):
        p1, firsts, p2 = exact_law(target, prompt, top)
        row: dict = {"prefix": i, "one_minus_max_p": 1 - float(p1.max())}
        for m, mode in enumerate(modes):  # independent draws per mode: seeds far apart
            drawn = draw(target, drafter, prompt, n, mode, shape, seed + 10**6 * (3 * i + m))
            row[mode] = law_report(drawn, p1, firsts, p2)
        rows.append(row)
    return rows


def _drafter_from(root: str, ref: str, target: Target, kind: str):
    from pipeline.core.drafters import load_drafter_dataset
    from storage import Store

    ds = Store(root).open(ref)
    return load_drafter_dataset(ds, target, target.identity, kind=kind).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", help="data root holding --drafter (else a drafter is fitted here)")
    ap.add_argument("--kind", required=True, choices=list(KINDS), help="the drafter's kind")
    ap.add_argument("--drafter", default="sft@latest")
    ap.add_argument("--draws", type=int, default=20_000)
    ap.add_argument("--top", type=int, default=64)
    ap.add_argument("--shape", choices=("tree", "chain"), default="tree")
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = load_target(EMBEDDED, aux_layer_ids=(1, 3, 5))  # the default profile's
    prompts = prefix_ids()
    drafter = (
        _drafter_from(args.root, args.drafter, target, args.kind)
        if args.root
        else fit_drafter(target, prompts, args.kind)
    )
    shape = TreeShape(3, 3, 12) if args.shape == "tree" else ChainShape(3)
    rows = measure(target, drafter, prompts, n=args.draws, shape=shape, top=args.top)
    print(
        json.dumps(
            {"shape": args.shape, "draws": args.draws, "prefixes": list(PREFIXES), "rows": rows},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
