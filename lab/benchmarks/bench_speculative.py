"""Speculative decoding: target forwards per token vs 1/tau, and the decoder's own overhead.

Target: the embedded one when trained, else a random target of its shape. Drafter: an EAGLE-3
drafter briefly fitted (TTT, 2 steps) on the target's own greedy continuations of the benchmark
prompts, so that drafts get accepted and blocks vary in length (a stand-in for a trained one;
pass --drafter DIR to use a `save_drafter` directory instead).

Per setting (temperature x batch size) it reports:
- target forwards per generated token, counted at the target's `forward`, excluding the prefill
  (one forward, which emits the first token) against 1/tau, tau = mean(accepted + 1): equal by
  construction of a lossless, budget-aware decoder (no EOS here, so every step emits accepted+1);
- overhead share: 1 - (time inside target and drafter forwards) / wall time of the whole call;
- wall-clock speed-up over plain KV-cached decoding (`target_generate`) of the same prompts.
Runs alternate speculative / plain, median of --repeats. Prints one JSON object.

    .venv/bin/python -m lab.benchmarks.bench_speculative [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from lab.benchmarks.bench_tree_scoring import embedded_or_random_target
from models.decoding import SpecConfig, speculative_generate, target_generate
from models.drafter import ChainShape
from models.drafters import DEFAULT_KIND, drafter_class, load_drafter
from models.features import Features
from models.losses import teacher_draft_probs
from models.target import Target
from models.vocab import DraftVocab


def fit_drafter(target: Target, sequences: torch.Tensor, draft_vocab: int, steps: int):
    """A drafter of the default kind (EAGLE-3) fitted with its warm-up loss (2 unrolled steps) to `sequences`."""
    counts = torch.bincount(sequences.reshape(-1), minlength=target.vocab_size).float()
    vocab = DraftVocab.from_counts(counts, draft_vocab)
    torch.manual_seed(0)
    drafter = drafter_class(DEFAULT_KIND).new(target, vocab, {})
    with torch.no_grad():
        out = target.forward(sequences)
        teacher = teacher_draft_probs(out.logits, vocab, 1.0)
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        unrolled = drafter.unroll(Features(sequences, out.aux_hidden, out.last_hidden), None, 2)
        loss = drafter.sft_loss(unrolled, teacher, out.last_hidden, decay=0.8, objective=None)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval(), float(loss.detach())


def count_forwards(target: Target) -> list[int]:
    calls = [0]
    real = target.forward

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    target.forward = counting
    return calls


def run_setting(target, drafter, prompts, calls, k, temperature, batch, max_new, repeats):
    spec_wall, plain_wall, model_s = [], [], []
    forwards = tokens = 0
    steps_accepted: list[int] = []
    for r in range(repeats):
        cfg = SpecConfig(ChainShape(k), temperature, max_new, seed=r, eos_token_ids=())
        forwards, tokens, steps_accepted = 0, 0, []
        start = time.perf_counter()
        inside = 0.0
        for i in range(0, len(prompts), batch):
            before = calls[0]
            result = speculative_generate(target, drafter, prompts[i : i + batch], cfg)
            forwards += calls[0] - before - 1  # minus the prefill
            tokens += sum(len(s) - 1 for s in result.sequences)  # minus the prefill's token
            steps_accepted += result.steps["accepted"]
            inside += (
                result.stats["target_forward_seconds"] + result.stats["drafter_forward_seconds"]
            )
        spec_wall.append(time.perf_counter() - start)
        model_s.append(inside)
        start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            target_generate(target, prompts[i : i + batch], max_new, temperature, r, ())
        plain_wall.append(time.perf_counter() - start)
    tau = sum(a + 1 for a in steps_accepted) / len(steps_accepted)
    overhead = [1 - m / w for m, w in zip(model_s, spec_wall, strict=True)]
    # At batch 1 every counted forward verifies one sequence. A batched call verifies all active
    # rows at once, so per sequence the forwards are its verify steps (from the step log).
    per_token = forwards / tokens if batch == 1 else len(steps_accepted) / tokens
    return {
        "temperature": temperature,
        "batch": batch,
        "k": k,
        "tau": round(tau, 4),
        "target_forwards_per_token": per_token,
        "counted_at": "Target.forward" if batch == 1 else "step log (per-sequence verifies)",
        "one_over_tau": 1 / tau,
        "equal": abs(per_token - 1 / tau) < 1e-12,
        "counted_target_calls_excl_prefill": forwards,
        "generated_tokens_excl_prefill": tokens,
        "overhead_share": round(statistics.median(overhead), 4),
        "speedup_vs_plain": round(statistics.median(plain_wall) / statistics.median(spec_wall), 3),
        "spec_wall_s": round(statistics.median(spec_wall), 4),
        "plain_wall_s": round(statistics.median(plain_wall), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fit-steps", type=int, default=150)
    parser.add_argument("--draft-vocab", type=int, default=2048)
    parser.add_argument("--drafter", default=None, help="a save_drafter directory")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, source = embedded_or_random_target()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, target.vocab_size, (args.prompts, args.prompt_len), generator=gen)
    prompts = prompts.tolist()
    fit_loss = None
    if args.drafter:
        drafter = load_drafter(args.drafter, target.embed_weight).eval()
    else:
        greedy = target_generate(target, prompts, args.max_new, 0.0, 0, ())
        sequences = torch.tensor([p + s for p, s in zip(prompts, greedy.sequences, strict=True)])
        drafter, fit_loss = fit_drafter(
            target, sequences, min(args.draft_vocab, target.vocab_size), args.fit_steps
        )
    calls = count_forwards(target)
    settings = [
        run_setting(target, drafter, prompts, calls, args.k, t, b, args.max_new, args.repeats)
        for t in (0.0, 1.0)
        for b in (1, args.prompts)
    ]
    report = {
        "benchmark": "speculative",
        "target": source,
        "layers": target.num_layers,
        "hidden": target.hidden_size,
        "vocab": target.vocab_size,
        "drafter": args.drafter or f"fitted {args.fit_steps} steps (final loss {fit_loss:.3f})",
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new,
        "threads": args.threads,
        "settings": settings,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
