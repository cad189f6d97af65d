"""`features.mode`: cached vs online, side by side in one run, on the embedded target.

Runs the real stages on one trajectories dataset (prompts -> generate with the default profile,
`--prompts` prompts x `--new-tokens` tokens), then for each mode the features stage and `sft`
for `--steps` steps (no validation, so only training is timed), alternating the modes
`--repeats` times and keeping each one's fastest run. Prints JSON:

- bytes_per_token: what the features dataset stores a token (its IPC shards / tokens) in each
  mode, and 8H (the hidden states online mode does not store) at this target and at H = 4096;
- features_stage_s, sft_s: wall time of each stage; sft_tokens_per_s (trained tokens / sft
  seconds) and the online / cached ratio of it;
- target_forwards_per_step: online sft's target forwards / optimizer steps (cached: 0); and
  target_tokens_per_trained_token: the tokens the target runs per trained token (cached: the
  features stage once, 1 / epochs; online: every batch, 1);
- end_to_end_s: features + sft in each mode, and its ratio.

    python -m lab.benchmarks.bench_features_mode [--prompts 64] [--new-tokens 96] [--steps 40] [--repeats 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import polars as pl
import torch

from pipeline.core.drafters import METRICS_FILE
from pipeline.core.runner import RunContext, run_stage
from pipeline.core.targets import TargetLoader
from pipeline.profiles import load_config
from pipeline.stages import features, generate, prompts, sft
from storage import Dataset, Store


def ipc_bytes(ds: Dataset) -> int:
    return sum(s["bytes"] for s in ds.manifest["shards"] if s["path"].endswith(".arrow"))


def measure(n_prompts: int, new_tokens: int, steps: int, repeats: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="bench-features-mode-"))
    try:
        cfg = load_config(
            "default",
            sets=[
                f"generate.max_prompts={n_prompts}",
                f"generate.max_new_tokens={new_tokens}",
                f"sft.steps={steps}",
                "sft.val_share=0",  # validation would add forwards to online mode only
            ],
        )
        store = Store(root)
        ctx = RunContext(store=store, target_loader=TargetLoader(cfg.target), progress=False)
        target = ctx.target_loader.target
        p = run_stage(prompts.STAGE, cfg.prompts, {}, ctx).dataset
        traj = run_stage(generate.STAGE, cfg.generate, {"prompts": p}, ctx).dataset
        modes = {
            "cached": cfg.features,
            "online": cfg.features.model_copy(update={"mode": "online"}),
        }
        best: dict[str, dict] = {}
        for rep in range(repeats):
            for mode, fcfg in modes.items():
                force = rep > 0  # time the stages again, on the same bytes
                f = run_stage(features.STAGE, fcfg, {"trajectories": traj}, ctx, force=force)
                s = run_stage(sft.STAGE, cfg.sft, {"features": f.dataset}, ctx, force=force)
                run = {
                    "features_stage_s": f.seconds,
                    "sft_s": s.seconds,
                    "features": f.dataset,
                    "sft": s.dataset,
                }
                if mode not in best or f.seconds + s.seconds < (
                    best[mode]["features_stage_s"] + best[mode]["sft_s"]
                ):
                    best[mode] = run
        out: dict = {
            "target": {"hidden_size": target.hidden_size, "num_layers": target.num_layers},
            "threads": torch.get_num_threads(),
            "sequences": traj.num_rows,
        }
        for mode, run in best.items():
            feats, trained = run["features"], run["sft"]
            tokens = int(feats.meta["tokens"])
            summary = trained.meta
            metrics = pl.read_parquet(trained.file(METRICS_FILE))
            trained_tokens = int(metrics.filter(pl.col("kind") == "train")["tokens"].sum())
            forwards = (summary.get("online_features") or {}).get("target_forwards_this_run", 0)
            out[mode] = {
                "features_bytes": ipc_bytes(feats),
                "bytes_per_token": round(ipc_bytes(feats) / tokens, 2),
                "features_stage_s": round(run["features_stage_s"], 2),
                "sft_s": round(run["sft_s"], 2),
                "sft_steps": summary["steps"],
                "sft_epochs": round(summary["epochs"], 3),
                "sft_tokens": trained_tokens,
                "sft_tokens_per_s": round(trained_tokens / run["sft_s"], 1),
                "target_forwards_per_step": round(forwards / summary["steps"], 3),
                "target_tokens_per_trained_token": round(
                    1.0 if mode == "online" else 1 / summary["epochs"], 3
                ),
                "end_to_end_s": round(run["features_stage_s"] + run["sft_s"], 2),
            }
        c, o = out["cached"], out["online"]
        out["hidden_bytes_per_token"] = {
            "this_target": 8 * target.hidden_size,
            "h4096": 8 * 4096,
        }
        out["ratios"] = {
            "bytes_per_token_online_over_cached": round(
                o["bytes_per_token"] / c["bytes_per_token"], 5
            ),
            "sft_tokens_per_s_online_over_cached": round(
                o["sft_tokens_per_s"] / c["sft_tokens_per_s"], 3
            ),
            "end_to_end_online_over_cached": round(o["end_to_end_s"] / c["end_to_end_s"], 3),
        }
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(json.dumps(measure(args.prompts, args.new_tokens, args.steps, args.repeats), indent=2))


if __name__ == "__main__":
    main()
