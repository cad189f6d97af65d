"""Training-step throughput of the embedded target's trainer, variants side by side.

Builds the target's model from the default `TrainConfig` and the committed tokenizer (random
init: speed does not depend on the weights) and times full optimizer steps (forward, fp32 loss,
backward, clip, AdamW) on random windows, for each variant in alternating rounds so host noise
hits all of them alike. Prints tokens/s per variant and each variant's ratio to the first.

    python -m lab.benchmarks.bench_target_train [--steps 8] [--rounds 3] [--variants ...]

Variants: `eager` (no compilation), `compile` (torch.compile of the model's forward only) and
`compile_loss` (the forward and the fp32 loss compiled together: what the trainer does).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from models.tiny_target.train import (
    DEFAULT_OUT,
    TrainConfig,
    make_optimizer,
    step_loss,
    train_step,
)

VARIANTS = ("eager", "compile", "compile_loss")


def build(cfg: TrainConfig, tokenizer) -> tuple[LlamaForCausalLM, torch.optim.Optimizer]:
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(cfg.llama_config(tokenizer))
    return model, make_optimizer(model, cfg)


def loss_fn_for(variant: str, model: torch.nn.Module):
    if variant == "compile":
        compiled = torch.compile(model)
        return lambda _model, windows, bf16: step_loss(compiled, windows, bf16)
    return torch.compile(step_loss) if variant == "compile_loss" else step_loss


def one_step(model, loss_fn, optimizer, cfg: TrainConfig, gen: torch.Generator) -> None:
    windows = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1), generator=gen)
    train_step(model, loss_fn, optimizer, windows, cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="timed steps per variant per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation) first")
    ap.add_argument("--variants", default="eager,compile,compile_loss")
    args = ap.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")

    cfg = TrainConfig()
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_OUT, local_files_only=True)
    torch.set_num_threads(cfg.threads)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    runs = {}
    for name in names:
        model, opt = build(cfg, tokenizer)
        loss_fn = loss_fn_for(name, model)
        gen = torch.Generator().manual_seed(0)
        t = time.perf_counter()
        for _ in range(args.warmup):
            one_step(model, loss_fn, opt, cfg, gen)
        print(f"{name}: warm-up {args.warmup} steps {time.perf_counter() - t:.1f}s", flush=True)
        runs[name] = (model, loss_fn, opt, gen, [])

    for r in range(args.rounds):
        for name, (model, loss_fn, opt, gen, times) in runs.items():
            t = time.perf_counter()
            for _ in range(args.steps):
                one_step(model, loss_fn, opt, cfg, gen)
            times.append(time.perf_counter() - t)
            print(f"round {r} {name}: {args.steps * tokens_per_step / times[-1]:.0f} tokens/s")

    steps = args.rounds * args.steps
    result = {
        name: {
            "tokens_per_s": round(steps * tokens_per_step / sum(times)),
            "s_per_step": round(sum(times) / steps, 3),
        }
        for name, (*_, times) in runs.items()
    }
    first = result[names[0]]["tokens_per_s"]
    for name in names:
        result[name][f"ratio_to_{names[0]}"] = round(result[name]["tokens_per_s"] / first, 3)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
