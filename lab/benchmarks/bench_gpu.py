"""The GPU checklist in one run (ratios as JSON), on whatever `--device` resolves to:

- generate: trajectories/s of vLLM vs HF on the same default-profile prompts (needs vLLM:
  the CUDA wheel on a GPU, `make vllm` on a CPU; skipped with the reason otherwise);
- features: the features stage vs the bare target forward over the same batches (goal <= 1.15);
- sft: training tokens/s and the loader's stall share (goal <= 5%).

    python -m lab.benchmarks.bench_gpu [--device auto] [--prompts 256] [--steps 30]

The sections run one after the other in this process; each prints the device it ran on.
"""

from __future__ import annotations

import argparse
import json

from lab.benchmarks import bench_features, bench_generate, bench_sft_loader
from models import vllm_engine
from pipeline.core.targets import TargetConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    out: dict = {}
    reason = vllm_engine.unavailable_reason()
    if reason is None:
        gen = bench_generate.measure(args.prompts, args.max_new_tokens, args.device)
        out["generate"] = gen
        out["vllm_over_hf_trajectories_per_s"] = round(gen["vllm_over_hf"], 3)
    else:
        out["generate"] = {"skipped": reason}
    target = TargetConfig(aux_layer_ids=[1, 3, 5], device=args.device)
    feats = bench_features.measure(args.sequences, 256, 3, target)
    out["features"] = feats
    out["features_over_bare_forward"] = feats["ratio_features_vs_bare"]
    sft = bench_sft_loader.measure(
        steps=args.steps,
        rows=256,
        batch_size=16,
        max_tokens=4096,
        draft_vocabs=[4096],
        device=args.device,
    )
    out["sft"] = sft
    out["sft_tokens_per_s"] = sft["bf16_vd4096"]["tokens_per_s"]
    out["sft_loader_stall_share"] = sft["bf16_vd4096"]["stall_share"]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
