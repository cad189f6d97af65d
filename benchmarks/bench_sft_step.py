"""Where an EAGLE-3 SFT step's time goes on a real target, per draft-vocabulary size and with
bf16 autocast on or off, measured side by side in one run.

One step of `pipeline.stages.sft` is: the teacher (the target's head over its whole vocabulary,
in blocks, at every position), the drafter's unrolled forward (ttt_steps steps of fc + one
decoder layer + the draft head) and its backward. This times each on a batch of real shape
(rows x tokens of the target's width; hidden states drawn at random: the cost does not depend
on their values) with the target's own LM head. Settings alternate within each repeat; the
median is reported. Prints one JSON object.

    .venv/bin/python -m benchmarks.bench_sft_step --target DIR [--vocab 2048 4096 8192]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from models.drafters import DEFAULT_KIND, drafter_class
from models.features import Features
from models.losses import teacher_draft_probs
from models.target import load_target
from models.vocab import DraftVocab
from pipeline.core.trainer import native_bf16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256, help="tokens per row (rows x seq a batch)")
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--vocab", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    target = load_target(args.target)
    H, V = target.hidden_size, target.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (args.rows, args.seq), generator=g)
    aux = torch.randn(args.rows, args.seq, 3 * H, generator=g)
    last = torch.randn(args.rows, args.seq, H, generator=g)
    mask = torch.ones(args.rows, args.seq, dtype=torch.bool)
    counts = torch.bincount(ids.reshape(-1), minlength=V).float() + 1
    settings = [(v, bf16) for v in args.vocab for bf16 in (False, True)]
    times: dict[tuple[int, bool], dict[str, list[float]]] = {s: {} for s in settings}
    drafters = {}
    for v in args.vocab:
        torch.manual_seed(0)
        vocab = DraftVocab.from_counts(counts, v)
        drafter = drafter_class(DEFAULT_KIND).new(target, vocab, {})
        drafters[v] = (drafter, drafter.training_module(), vocab)
    for _ in range(args.repeats):
        for v, bf16 in settings:
            drafter, module, vocab = drafters[v]
            t = times[(v, bf16)]
            start = time.perf_counter()
            with torch.no_grad():
                logits = target.teacher(last, vocab, [1.0])
                teacher = teacher_draft_probs(logits, vocab, 1.0)
            t.setdefault("teacher_s", []).append(time.perf_counter() - start)
            start = time.perf_counter()
            # torch's autocast itself: the trainers' `autocast` falls back to fp32 where bf16
            # would be emulated, and this measures what that fallback avoids
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                (out,) = module((Features(ids, aux, last), mask, None, args.ttt))
            loss = drafter.sft_loss(out, teacher, last, decay=0.8, objective=None)
            t.setdefault("forward_s", []).append(time.perf_counter() - start)
            start = time.perf_counter()
            loss.backward()
            module.zero_grad(set_to_none=True)
            t.setdefault("backward_s", []).append(time.perf_counter() - start)

    tokens = args.rows * args.seq
    rows = []
    for (v, bf16), t in times.items():
        med = {k: statistics.median(x) for k, x in t.items()}
        step = sum(med.values())
        rows.append(
            {
                "draft_vocab": v,
                "bf16": bf16,
                **{k: round(x, 3) for k, x in med.items()},
                "step_s": round(step, 3),
                "tokens_per_s": round(tokens / step, 1),
            }
        )
    fastest = min(r["step_s"] for r in rows)
    for r in rows:
        r["step_vs_fastest"] = round(r["step_s"] / fastest, 2)
    print(
        json.dumps(
            {
                "target": str(args.target),
                "hidden": H,
                "vocab": V,
                "layers": target.config.num_hidden_layers,
                "batch_tokens": tokens,
                "ttt_steps": args.ttt,
                "threads": torch.get_num_threads(),
                "native_bf16": native_bf16("cpu"),
                "settings": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
