"""The `generate` stage on vLLM vs on HF transformers: trajectories/s, same prompts and budget.

Builds the embedded target's prompts once, then runs the generate stage (default profile: T=0,
HF batches of 32) into the same store with `backend=hf` and with `backend=vllm` on the same
first `--prompts` train prompts and `--max-new-tokens`. vLLM's engine is started before its
stage is timed and its start-up is reported on its own (it is paid once per process, whatever
the number of prompts). Prints JSON: both rates, their ratio with and without the start-up, and
the share of trajectories that came out identical.

    python -m lab.benchmarks.bench_generate [--prompts 256] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from models import vllm_engine
from pipeline.core.runner import RunContext, run_stage
from pipeline.core.targets import TargetLoader, resolve_dtype
from pipeline.profiles import load_config
from pipeline.stages import generate, prompts
from storage import Store


def measure(prompts_n: int, max_new_tokens: int, device: str = "auto") -> dict:
    """HF vs vLLM `generate` on the same default-profile prompts, run one after the other."""
    reason = vllm_engine.unavailable_reason()
    if reason is not None:
        raise SystemExit(reason)
    sets = [
        f"generate.max_prompts={prompts_n}",
        f"generate.max_new_tokens={max_new_tokens}",
        f"target.device={device}",
    ]
    cfg = load_config("default", None, sets)
    with tempfile.TemporaryDirectory() as tmp:
        loader = TargetLoader(cfg.target)
        ctx = RunContext(store=Store(Path(tmp)), target_loader=loader, progress=False)
        prompts_ds = run_stage(prompts.STAGE, cfg.prompts, {}, ctx).dataset
        out, seconds = {}, {}
        for backend in ("hf", "vllm"):
            stage_cfg = cfg.generate.model_copy(update={"backend": backend})
            if backend == "vllm":
                t0 = time.perf_counter()
                vllm_engine.engine(
                    vllm_engine.EngineSpec(str(loader.directory), resolve_dtype(cfg.target))
                )
                seconds["vllm_engine_start"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            out[backend] = run_stage(
                generate.STAGE, stage_cfg, {"prompts": prompts_ds}, ctx
            ).dataset
            seconds[backend] = time.perf_counter() - t0
        rows = {b: ds.scan().collect()["input_ids"].to_list() for b, ds in out.items()}
        vllm_engine.close()
    n = len(rows["hf"])
    with_start = seconds["vllm"] + seconds["vllm_engine_start"]
    return {
        "device": str(loader.target.device),
        "trajectories": n,
        "max_new_tokens": max_new_tokens,
        "hf_batch_size": cfg.generate.batch_size,
        "hf_trajectories_per_s": n / seconds["hf"],
        "vllm_trajectories_per_s": n / seconds["vllm"],
        "vllm_engine_start_s": seconds["vllm_engine_start"],
        "vllm_over_hf": seconds["hf"] / seconds["vllm"],
        "vllm_over_hf_with_engine_start": seconds["hf"] / with_start,
        "identical_trajectories": sum(a == b for a, b in zip(rows["hf"], rows["vllm"], strict=True))
        / n,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    print(json.dumps(measure(args.prompts, args.max_new_tokens, args.device), indent=2))


if __name__ == "__main__":  # vLLM starts its engine in a spawned process, which imports this file
    main()
