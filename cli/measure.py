"""`opd eval` and `opd analyze`: measure a drafter, read a rejection log."""

from __future__ import annotations

import json

import click

from cli.common import PROFILE_HELP, command_config, command_target, setup_logging
from storage import Store, check_run_name


@click.command("eval")
@click.option(
    "--drafter",
    "drafter_ref",
    default="sft@latest",
    show_default=True,
    help="An sft or opd dataset.",
)
@click.option("--prompts", "prompts_ref", default="prompts@latest", show_default=True)
@click.option(
    "--k", type=int, default=None, help="Drafted tokens per verify step [profile: drafting.k]."
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
    from pipeline.core.runner import RunContext, run_stage
    from pipeline.stages import evaluate

    extra = (f"evaluate.temperature={temperature}",) if temperature is not None else ()
    extra += (f"evaluate.backend={backend}",) if backend is not None else ()
    cfg = command_config(profile, sets + extra, k)
    inputs = {"prompts": store.open(prompts_ref), "drafter": store.open(drafter_ref)}
    cfg, loader = command_target(cfg, profile, sets, inputs.values())
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
        click.echo(f"  tau {stats['tau']:.3f}   alpha by offset [{alpha}]")
        if "tau_untrained" in stats:
            click.echo(
                f"  an untrained drafter on the same prompts: tau {stats['tau_untrained']:.3f}"
            )
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
