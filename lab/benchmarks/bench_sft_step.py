"""Where an SFT step's time goes on a real target, per draft-vocabulary size, with bf16 autocast
on or off, and with the teacher's full-vocabulary head run every step or cached, measured side
by side in one run.

One step of `pipeline.stages.sft` is: the teacher, the drafter's unrolled forward (for EAGLE-3,
ttt_steps steps of fc + one decoder layer + the draft head) and its backward. The teacher is
either the target's head over its whole vocabulary, in blocks, at every position (`full`: what
every step ran before the cache, and what the first epoch still runs) or the draft ids' rows of
it with the full argmax from `models.teacher.ArgmaxCache` (`cached`: every later epoch). This
times each on a batch of real shape (rows x tokens of the target's width; hidden states drawn
at random: the cost does not depend on their values) with the target's own LM head. Settings
alternate within each repeat; the median is reported. Prints one JSON object.

    .venv/bin/python -m lab.benchmarks.bench_sft_step --target DIR [--kind KIND --set SETTING=VALUE]
        [--vocab 2048 4096 8192] [--bf16 off]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from models.drafters import DEFAULT_KIND, KINDS, drafter_class
from models.features import Features
from models.losses import teacher_draft_probs
from models.target import load_target
from models.teacher import ArgmaxCache
from models.vocab import DraftVocab
from pipeline.core.trainer import native_bf16


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256, help="tokens per row (rows x seq a batch)")
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--vocab", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kind", choices=sorted(KINDS), default=DEFAULT_KIND)
    ap.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=INT",
        help="a setting of --kind's drafter, e.g. anchors=64 (repeatable)",
    )
    ap.add_argument("--bf16", choices=["both", "off", "on"], default="both")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    settings_of_kind = {k: int(v) for k, v in (kv.split("=", 1) for kv in args.settings)}

    target = load_target(args.target)
    H, V = target.hidden_size, target.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (args.rows, args.seq), generator=g)
    aux = torch.randn(args.rows, args.seq, 3 * H, generator=g)
    last = torch.randn(args.rows, args.seq, H, generator=g)
    mask = torch.ones(args.rows, args.seq, dtype=torch.bool)
    counts = torch.bincount(ids.reshape(-1), minlength=V).float() + 1
    rows, lengths = torch.arange(args.rows), mask.sum(1)
    modes = {"both": (False, True), "off": (False,), "on": (True,)}[args.bf16]
    settings = [(v, bf16, t) for v in args.vocab for bf16 in modes for t in ("full", "cached")]
    times: dict[tuple[int, bool, str], dict[str, list[float]]] = {s: {} for s in settings}
    drafters = {}
    for v in args.vocab:
        torch.manual_seed(0)
        vocab = DraftVocab.from_counts(counts, v)
        drafter = drafter_class(args.kind).new(target, vocab, settings_of_kind)
        cache = ArgmaxCache(target.lm_head_weight, vocab.draft_to_target_ids)
        cache.teacher(last, rows, lengths)  # the first epoch's read fills it
        drafters[v] = (drafter, drafter.training_module(), vocab, cache)
    for _ in range(args.repeats):
        for v, bf16, teacher_mode in settings:
            drafter, module, vocab, cache = drafters[v]
            t = times[(v, bf16, teacher_mode)]
            start = time.perf_counter()
            with torch.no_grad():
                if teacher_mode == "cached":
                    logits = cache.teacher(last, rows, lengths)
                else:
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
    out_rows = []
    for (v, bf16, teacher_mode), t in times.items():
        med = {k: statistics.median(x) for k, x in t.items()}
        step = sum(med.values())
        out_rows.append(
            {
                "draft_vocab": v,
                "bf16": bf16,
                "teacher": teacher_mode,
                **{k: round(x, 3) for k, x in med.items()},
                "step_s": round(step, 3),
                "tokens_per_s": round(tokens / step, 1),
            }
        )
    fastest = min(r["step_s"] for r in out_rows)
    for r in out_rows:
        r["step_vs_fastest"] = round(r["step_s"] / fastest, 2)
    full_steps = {
        (r["draft_vocab"], r["bf16"]): r["step_s"] for r in out_rows if r["teacher"] == "full"
    }
    for r in out_rows:
        if r["teacher"] == "cached":
            r["full_teacher_step_vs_this"] = round(
                full_steps[(r["draft_vocab"], r["bf16"])] / r["step_s"], 2
            )
    print(
        json.dumps(
            {
                "target": str(args.target),
                "kind": args.kind,
                "drafter_settings": settings_of_kind,
                "hidden": H,
                "vocab": V,
                "layers": target.config.num_hidden_layers,
                "batch_tokens": tokens,
                "ttt_steps": args.ttt,
                "threads": torch.get_num_threads(),
                "native_bf16": native_bf16("cpu"),
                "settings": out_rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
