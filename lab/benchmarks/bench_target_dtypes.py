"""The target's own work in fp32 and in bf16 on this machine, side by side: what `auto` should
resolve to here (`pipeline.core.precision.native_bf16`).

Loads one target directory twice (fp32, bf16) and times, alternating the dtypes every repeat so
a busy machine slows both alike (median of `--repeats`):

- `decode`: one batch-1 forward of 1 token on a KV cache of `--context` tokens (plain
  decoding's step), and of `--verify` tokens (a speculative verify of K = verify - 1 drafts);
- `features`: one forward over a `[--rows, --seq]` batch without a cache (features, scoring,
  prefill), the aux layers captured as the stage does.

Prints one JSON object: seconds per dtype, the bf16/fp32 speed ratio per workload (above 1:
bf16 is faster), the verify's cost over a 1-token step per dtype, and the CPU capability.

    python -m lab.benchmarks.bench_target_dtypes --target opd-data/targets/smollm2 [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from models.target import Target, load_target
from pipeline.core.precision import cpu_capability, native_bf16

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _decode_step(target: Target, context: torch.Tensor, width: int) -> Callable[[], object]:
    """A forward of `width` new tokens on a cache holding `context` (cropped back each call)."""
    cache = target.new_cache()
    target(context, cache=cache)
    length = context.shape[1]
    new = context[:, :width]

    def step() -> object:
        out = target(new, cache=cache)
        Target.crop_cache(cache, length)
        return out

    return step


def measure(args: argparse.Namespace) -> dict:
    g = torch.Generator().manual_seed(0)
    targets = {name: load_target(args.target, dtype=dtype) for name, dtype in DTYPES.items()}
    vocab = next(iter(targets.values())).vocab_size
    context = torch.randint(0, vocab, (1, args.context), generator=g)
    batch = torch.randint(0, vocab, (args.rows, args.seq), generator=g)
    workloads = {
        "decode_1": lambda t: _decode_step(t, context, 1),
        f"decode_{args.verify}": lambda t: _decode_step(t, context, args.verify),
        "features": lambda t: lambda: t.forward_features(batch),
    }
    calls = {(w, d): make(targets[d]) for w, make in workloads.items() for d in targets}
    for fn in calls.values():  # warm-up: weight layouts, allocator, oneDNN's kernel choice
        fn()
    times: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
    for r in range(args.repeats):
        order = list(DTYPES) if r % 2 == 0 else list(reversed(DTYPES))
        for w in workloads:
            for d in order:
                times[(w, d)].append(_seconds(calls[(w, d)]))
    median = {key: statistics.median(v) for key, v in times.items()}
    rows = {
        w: {
            "fp32_s": round(median[(w, "float32")], 5),
            "bf16_s": round(median[(w, "bfloat16")], 5),
            "bf16_speedup": round(median[(w, "float32")] / median[(w, "bfloat16")], 3),
        }
        for w in workloads
    }
    verify = f"decode_{args.verify}"
    return {
        "target": args.target,
        "threads": torch.get_num_threads(),
        "cpu_capability": cpu_capability(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": native_bf16("cpu"),
        "context": args.context,
        "features_batch": [args.rows, args.seq],
        "repeats": args.repeats,
        "workloads": rows,
        "verify_over_step": {
            d: round(median[(verify, d)] / median[("decode_1", d)], 3) for d in DTYPES
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="a target directory (load_target)")
    ap.add_argument("--context", type=int, default=256, help="cached tokens before a step")
    ap.add_argument("--verify", type=int, default=7, help="tokens in one verify forward")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(measure(args), indent=1))


if __name__ == "__main__":
    main()
