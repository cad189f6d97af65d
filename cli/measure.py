"""`opd eval`, `opd analyze`, `opd tune`: measure a drafter, read a rejection log, find the K
that decodes fastest here."""

from __future__ import annotations

import json
import math

import click

from cli.common import (
    DRAFTER_OPTION,
    PROFILE_HELP,
    check_prompts_dataset,
    command_config,
    command_target,
    setup_logging,
)
from storage import OpdError, Store, check_run_name


@click.command("eval")
@DRAFTER_OPTION
@click.option("--prompts", "prompts_ref", default="prompts@latest", show_default=True)
@click.option(
    "--k",
    type=int,
    default=None,
    help="Drafted tokens per verify step [the drafter's trained K, or the profile's drafting.k "
    "when --profile is given].",
)
@click.option(
    "--temperature",
    type=float,
    default=None,
    help="Sampling temperature [profile: evaluate.temperature].",
)
@click.option(
    "--backend",
    type=click.Choice(["hf", "vllm"]),
    default=None,
    help="vllm: also run the drafter's export inside vLLM (tau_vllm) [profile: evaluate.backend].",
)
@click.option("--profile", default=None, help=PROFILE_HELP)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE")
@click.option("--force", is_flag=True, help="Re-measure even if this evaluation exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the numbers as JSON.")
@click.pass_obj
def eval_cmd(
    store: Store,
    drafter_ref: str,
    prompts_ref: str,
    k: int | None,
    temperature: float | None,
    backend: str | None,
    profile: str | None,
    sets: tuple[str, ...],
    force: bool,
    as_json: bool,
) -> None:
    """Measure τ, per-position acceptance and speed-up of a drafter on held-out prompts."""
    from pipeline.core.config import LOSSY_NOTE, is_lossy
    from pipeline.core.runner import RunContext, run_stage
    from pipeline.core.targets import check_engine_target
    from pipeline.stages import evaluate

    extra = (f"evaluate.temperature={temperature}",) if temperature is not None else ()
    extra += (f"evaluate.backend={backend}",) if backend is not None else ()
    cfg = command_config(profile, sets + extra, k)  # bad settings fail before any input opens
    inputs = {"prompts": store.open(prompts_ref), "drafter": store.open(drafter_ref)}
    if k is None and profile is None and not any(s.startswith("drafting.k=") for s in sets):
        from pipeline.core.tuning import trained_k

        # like the target: the drafter's own trained K, unless the command line states one
        cfg = command_config(profile, sets + extra, trained_k(inputs["drafter"]))
    cfg, loader = command_target(cfg, profile, sets, inputs.values())
    # not after the whole evaluation
    check_engine_target("evaluate", cfg.evaluate, cfg.target, option="--backend")
    ctx = RunContext(store=store, target_loader=loader, progress=not as_json)
    if not as_json:
        setup_logging()
    res = run_stage(evaluate.STAGE, cfg.evaluate, inputs, ctx, force=force)
    stats = {k2: v for k2, v in res.dataset.meta.items()} | {"eval": str(res.ref)}
    if as_json:
        click.echo(json.dumps(stats, indent=2))
    else:
        alpha = " ".join(f"{a:.3f}" for a in stats["alpha"])
        click.echo(
            f"{res.ref}  drafter={stats['drafter']}  K={stats['k']} T={stats['temperature']}"
        )
        if is_lossy(stats):  # from the dataset's meta: a cache hit logs no stage line
            click.echo(f"  LOSSY: {LOSSY_NOTE}")
        click.echo(f"  tau {stats['tau']:.3f}   alpha by offset [{alpha}]")
        if "alpha_reached" in stats:  # evals written before the counts were recorded lack them
            reached = " ".join(map(str, stats["alpha_reached"]))
            click.echo(f"  drafts reaching each offset [{reached}]")
        if "tau_untrained" in stats:
            click.echo(
                f"  an untrained drafter on the same prompts: tau {stats['tau_untrained']:.3f}"
            )
        if "free_baseline" in stats:
            click.echo(f"  {evaluate.baseline_line(stats['free_baseline'])}")
        click.echo(f"  target forwards per token {stats['target_forwards_per_token']:.4f}")
        if "tau_vllm" in stats:
            click.echo(f"  inside vLLM: tau {stats['tau_vllm']:.3f}")
        if "tau_vllm_note" in stats:
            click.echo(f"  note: {stats['tau_vllm_note']}")
        if "speedup" in stats:
            click.echo(
                f"  {stats['tokens_per_s']:.1f} tok/s vs {stats['baseline_tokens_per_s']:.1f} plain ({stats['speedup']:.2f}x)"
            )


@click.command("analyze")
@click.option(
    "--input",
    "input_refs",
    multiple=True,
    metavar="REF",
    help="A rollouts or eval dataset; repeat to compare several side by side [default: latest rollouts, else latest eval].",
)
@click.option(
    "--run", "run_name", default=None, help="Compare the rollouts of every round of this run."
)
@click.option(
    "--top",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="Most rejected tokens to list.",
)
@click.option(
    "--bins",
    type=click.IntRange(min=2),
    default=10,
    show_default=True,
    help="Confidence bins for the calibration table.",
)
@click.option(
    "--position-bucket",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Tokens per sequence-position bucket.",
)
@click.option("--profile", default=None, help=PROFILE_HELP)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE")
@click.option("--force", is_flag=True, help="Rebuild the report even if this version exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the headline numbers as JSON.")
@click.pass_obj
def analyze_cmd(
    store: Store,
    input_refs: tuple[str, ...],
    run_name: str | None,
    top: int,
    bins: int,
    position_bucket: int,
    profile: str | None,
    sets: tuple[str, ...],
    force: bool,
    as_json: bool,
) -> None:
    """Report on a rejection log: n-α, τ per sequence, calibration, top rejected tokens, rounds."""
    from pipeline.core.runner import RunContext, run_stage
    from pipeline.stages import analyze

    if run_name is not None:
        check_run_name(run_name)
    cfg = command_config(profile, sets)
    inputs = analyze.resolve_sources(store, input_refs, run_name)
    _, loader = command_target(cfg, profile, sets, inputs.values())
    cfg = analyze.Config(top_tokens=top, confidence_bins=bins, position_bucket=position_bucket)
    res = run_stage(
        analyze.STAGE,
        cfg,
        inputs,
        RunContext(store=store, target_loader=loader, progress=False),
        force=force,
    )
    if as_json:
        click.echo(
            json.dumps(
                res.dataset.meta
                | {"report": str(res.ref), "path": str(res.dataset.path / "report.md")},
                indent=2,
            )
        )
    else:
        click.echo(analyze.summary_text(res))


@click.command("tune")
@click.option("--drafter", "drafter_ref", default="opd@latest", show_default=True)
@click.option("--prompts", "prompts_ref", default="prompts@latest", show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="Serving T.")
@click.option("--max-prompts", type=int, default=None, help="[profile: evaluate.max_prompts]")
@click.option("--repeats", type=int, default=2, show_default=True, help="Best of N per setting.")
@click.option(
    "--candidates", type=int, default=3, show_default=True, help="Best predicted settings timed."
)
@click.option("--profile", default=None, help=PROFILE_HELP)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE")
@click.option(
    "--threads",
    type=int,
    default=1,
    show_default=True,
    help="torch CPU threads: a batch-1 decode runs fastest on one, and on a shared machine "
    "more threads spin against the other jobs.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the whole result as JSON.")
@click.pass_obj
def tune_cmd(
    store: Store,
    drafter_ref: str,
    prompts_ref: str,
    temperature: float,
    max_prompts: int | None,
    repeats: int,
    candidates: int,
    profile: str | None,
    sets: tuple[str, ...],
    threads: int,
    as_json: bool,
) -> None:
    """Measure the K and stop threshold that decode a drafter fastest on this machine (batch
    1, the held-out prompts evaluate uses); `opd export` then serves with that K."""
    import torch

    from models.draft_length import TuneOptions
    from pipeline.core.tuning import heldout_prompts, run_tune

    _check_tune_options(temperature, max_prompts, repeats, candidates, threads)
    torch.set_num_threads(threads)
    cfg = command_config(profile, sets)
    if cfg.drafting.acceptance == "typical":
        raise OpdError(
            "opd tune times lossless decoding, as vLLM serves the K it records (vLLM verifies "
            "losslessly only), and drafting.acceptance=typical is lossy: drop it (opd eval "
            "--set drafting.acceptance=typical measures a drafter with it)"
        )
    drafter, prompts_ds = store.open(drafter_ref), store.open(prompts_ref)
    check_prompts_dataset(prompts_ds, "--prompts")
    cfg, loader = command_target(cfg, profile, sets, [drafter, prompts_ds])
    ecfg = cfg.evaluate
    n_prompts = ecfg.max_prompts if max_prompts is None else max_prompts
    prompts = heldout_prompts(prompts_ds, ecfg.split, n_prompts)
    opts = TuneOptions(ecfg.max_new_tokens, repeats=repeats, candidates=candidates)
    result = run_tune(drafter, prompts, loader, temperature, cfg.drafting.k, opts)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    for name, row in result["measured"].items():
        setting = row.get("setting")
        what = (
            "plain decoding" if setting is None else f"K={setting['k']} stop={setting['threshold']}"
        )
        speed = f"{row['tokens_per_s']:.1f} tok/s"
        if "speedup_vs_plain" in row:
            predicted = row["predicted"]["speedup_vs_plain"]
            speed += f" {row['speedup_vs_plain']:.2f}x (predicted {predicted:.2f}x)"
        click.echo(f"  {name:<12} {what:<18} {speed}")
    chosen, serve = result["chosen"], result["serve"]
    click.echo(
        f"chosen at T={temperature} ({chosen['by']}): K={chosen['k']} stop={chosen['threshold']} "
        f"({chosen['speedup_vs_plain']}x measured); serve with K={serve['k']} (vLLM drafts a "
        "fixed K)"
    )


def _check_tune_options(
    temperature: float, max_prompts: int | None, repeats: int, candidates: int, threads: int
) -> None:
    """Refuse, before any work, a setting `opd tune` would record as measured."""
    counts = [("--repeats", repeats), ("--candidates", candidates), ("--threads", threads)]
    if max_prompts is not None:  # 0 would read as unset, a negative count as a slice
        counts.insert(0, ("--max-prompts", max_prompts))
    for name, value in counts:
        if value < 1:
            raise OpdError(f"{name} must be >= 1, got {value}")
    if not math.isfinite(temperature) or temperature < 0:
        raise OpdError(
            f"--temperature must be a finite number >= 0 (0 = greedy), got {temperature}"
        )
