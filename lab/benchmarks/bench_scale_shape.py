"""What a real run costs: every stage of `opd run full` at a real model's shape, measured.

Runs the `full` chain (the `tiny` profile's settings, more prompts and tokens than it, a 32k
draft vocabulary, K = 6) on `target.path=shape:NAME` (random weights, the real vocabulary; depth
and width overridable so it fits the machine) or on the embedded target, one stage at a time in
this process, and prints JSON with, per stage: seconds, tokens and tokens/s (what "a token" is
per stage is named in `unit`), peak host memory (the process's resident high-water mark during
the stage: VmHWM, reset before each stage) and peak GPU memory, and bytes written per token.

Then the speed-up a drafter would give at that shape: the target's verify forwards and the
trained drafter's forward are timed here at batch 1 (`models.draft_length.calibrate`), and the
cost model is fed with them and with the three τ measured on the embedded target (`EMBEDDED_TAU`
below; docs/scale.md cites where each comes from). Random weights accept nothing, so this is a
projection.

    python -m lab.benchmarks.bench_scale_shape --shape llama-3.1-8b --layers 4 --width 2048
    python -m lab.benchmarks.bench_scale_shape --shape embedded
    python -m lab.benchmarks.bench_scale_shape --shape llama-3.1-8b --layers 32 --set drafter.kind=KIND
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import torch

from models.draft_length import TuneOptions, calibrate, predict_at_tau
from models.shapes import SHAPES
from pipeline.chains import Step, full_chain, run_chain
from pipeline.core.drafters import load_drafter_dataset
from pipeline.core.runner import RunContext, StageResult, run_stage
from pipeline.core.targets import TargetLoader
from pipeline.profiles import load_config
from storage import Dataset, Store

# τ at T=0, K=6 on the embedded target's 48 held-out prompts (lab/notebook/, "EAGLE-3 with
# five rounds"): the SFT warm-up, continued SFT and Draft-OPD (five rounds, 2x budget, seed mean).
EMBEDDED_TAU = {"sft_warmup": 2.657, "continued_sft": 3.132, "draft_opd": 3.498}


def _peak_rss_reset() -> None:
    """Reset this process's resident high-water mark (Linux: `5` to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _bytes(ds: Dataset) -> int:
    return sum(p.stat().st_size for p in ds.path.rglob("*") if p.is_file())


def _tokens(step: Step, ds: Dataset, seconds: float) -> tuple[float, str]:
    """(tokens, unit) of one stage's work, from its dataset."""
    meta, name = ds.meta, step.stage.name
    if name == "generate":
        table = ds.read_table()
        lengths = pc.list_value_length(table["input_ids"])
        return float(pc.sum(pc.subtract(lengths, table["prompt_len"])).as_py()), "generated"
    if name == "features":
        return float(meta["tokens"]), "cached (prompt + generated)"
    if name == "sft":
        return meta["tokens_per_s_this_run"] * seconds, "trained (x ttt_steps unrolled)"
    if name == "rollout":
        return float(meta["generated_tokens"]), "generated speculatively"
    if name == "score":
        return float(meta["replays"] * meta["k"]), "replayed draft slots scored"
    if name == "opd":
        return meta["row_steps_per_s_this_run"] * seconds, "replay row-steps trained"
    if name == "evaluate":
        return float(meta["emitted_tokens"]), "emitted (speculative decode + plain baseline)"
    return 0.0, "-"


def measure(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    sets = [
        f"target.device={args.device}",
        "generate.backend=hf",  # a shape target has no directory for vLLM; both sides alike
        f"prompts.max_train_rows={args.prompts}",
        f"generate.max_prompts={args.prompts}",
        f"generate.max_new_tokens={args.max_new_tokens}",
        f"rollout.max_prompts={args.prompts}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"features.draft_vocab_size={args.draft_vocab}",
        f"drafting.k={args.k}",
        f"drafting.ttt_steps={args.k}",
    ]
    if args.shape != "embedded":
        sets += [f"target.path=shape:{args.shape}", f"target.shape.num_layers={args.layers}"]
        if args.width is not None:
            sets.append(f"target.shape.hidden_size={args.width}")
    else:
        sets.append("target.path=embedded")
    sets += args.set  # last, so a user's --set wins over the benchmark's own
    cfg = load_config("tiny", None, sets)
    loader = TargetLoader(cfg.target)
    ctx = RunContext(store=Store(root), target_loader=loader, progress=False)
    _peak_rss_reset()
    start = time.perf_counter()
    target = loader.target
    out: dict[str, Any] = {
        "target": {
            "path": cfg.target.path,
            "layers": target.num_layers,
            "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size,
            "parameters": sum(p.numel() for p in target.model.parameters()),
            "dtype": str(target.dtype),
            "build_s": round(time.perf_counter() - start, 2),
            "peak_host_bytes": _peak_rss(),
        },
        "drafter_kind": cfg.drafter.kind,
        "device": str(target.device),
        "threads": torch.get_num_threads(),
        "sets": sets,
        "stages": {},
    }
    cuda = target.device.type == "cuda"

    def execute(step: Step, inputs: dict[str, Dataset]) -> StageResult:
        _peak_rss_reset()
        if cuda:
            torch.cuda.reset_peak_memory_stats(target.device)
        result = run_stage(step.stage, step.cfg, inputs, ctx)
        tokens, unit = _tokens(step, result.dataset, result.seconds)
        written = _bytes(result.dataset)
        out["stages"][step.key] = {
            "seconds": round(result.seconds, 2),
            "tokens": round(tokens),
            "unit": unit,
            "tokens_per_s": round(tokens / result.seconds, 2) if tokens else None,
            "peak_host_bytes": _peak_rss(),
            "peak_gpu_bytes": torch.cuda.max_memory_allocated(target.device) if cuda else None,
            "bytes_written": written,
            "bytes_per_token": round(written / tokens, 1) if tokens else None,
        }
        if args.out is not None:  # each stage as it ends: a run cut short keeps what it measured
            args.out.write_text(json.dumps(out, indent=2))
        return result

    results = run_chain(full_chain(cfg), ctx, execute=execute)
    drafter = load_drafter_dataset(results["sft"].dataset, target, loader.identity)
    drafter = drafter.to(target.device)
    prompts = [r["prompt_ids"] for r in results["prompts"].dataset.read_table().to_pylist()]
    prompts = prompts[: args.cost_prompts]
    opts = TuneOptions(max_new_tokens=args.cost_tokens, verify_reps=args.verify_reps)
    _, costs, _ = calibrate(target, drafter, prompts, 0.0, args.k, opts)
    plain_s = costs.verify_s[1]
    out["step_costs"] = {
        "verify_s": {n: round(s, 6) for n, s in costs.verify_s.items()},
        "drafter_s_per_forward": round(costs.drafter_s, 6),
        "drafter_over_target_forward": round(costs.drafter_s / plain_s, 4),
        "overhead_s_per_step": round(costs.overhead_s, 6),
    }
    # EAGLE-3's τ on the embedded target for every kind: the speed-up a drafter's step costs
    # buy at one τ, not a τ measured for this kind.
    out["projected_at_tau"] = EMBEDDED_TAU
    out["projected_speedup"] = {
        name: round(predict_at_tau(tau, costs, args.k).tokens_per_s * plain_s, 3)
        for name, tau in EMBEDDED_TAU.items()
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b", choices=[*SHAPES, "embedded"])
    ap.add_argument("--layers", type=int, default=4, help="depth override (>= 4)")
    ap.add_argument("--width", type=int, default=None, help="width override (None: full)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--cost-prompts", type=int, default=4)
    ap.add_argument("--cost-tokens", type=int, default=32)
    ap.add_argument("--verify-reps", type=int, default=5)
    ap.add_argument("--root", type=Path, default=None, help="data root (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here, per stage")
    ap.add_argument(
        "--set", action="append", default=[], help="config override, e.g. drafter.kind=KIND"
    )
    args = ap.parse_args()
    if args.root is not None:
        out = measure(args, args.root)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = measure(args, Path(tmp))
    out["cpus"] = os.cpu_count()
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
