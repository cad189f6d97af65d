"""`opd experiment ...`: the studies comparing Draft-OPD with continued SFT, losses and objectives.

The `opd` command is the product's command group (cli.main) plus this one: the lab imports the
product, never the other way round, so the product runs and installs its commands without it.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from cli.common import check_prompts_dataset, command_config, command_target, setup_logging
from cli.main import cli
from lab.publish import publish
from lab.recipes import RECIPE_DIR, Recipe, load_recipe, recipe_names
from storage import Store


@click.group("experiment")
def experiment_group() -> None:
    """Experiments that compare training methods end to end, each from a named recipe
    (`opd experiment recipes` lists them)."""


_RECIPE = click.option(
    "--recipe",
    "recipe_name",
    required=True,
    metavar="NAME",
    help="The recipe: its profile, overrides and prompts (`opd experiment recipes`), or a "
    "recipe file's path ending in .toml.",
)
_PROMPTS = click.option(
    "--prompts",
    "prompts_ref",
    default=None,
    help="Train on this prompts dataset instead of running the recipe's prompts stage.",
)
_DRY_RUN = click.option(
    "--dry-run",
    is_flag=True,
    help="Check the recipe and its configs, print what would run; run nothing.",
)
_BUDGET = click.option(
    "--budget",
    type=click.IntRange(min=1),
    default=None,
    help="Drafter row-steps per arm or variant [default: --budget-ratio x the warm-up's].",
)
_FIRST_SEED = click.option(
    "--first-seed",
    type=int,  # bounded by check_arm_options, a one-line error like every refusal
    default=None,
    help="First seed of the arms or variants [default: sft.seed]; the warm-up keeps sft.seed, "
    "so processes running disjoint seeds share it.",
)
_JSON = click.option("--json", "as_json", is_flag=True, help="Print the whole result as JSON.")


def _seeds(default: int, what: str):
    return click.option(
        "--seeds",
        type=click.IntRange(min=1),
        default=default,
        show_default=True,
        help=f"{what} (mean and spread over them).",
    )


def _budget_ratio(default: float, why: str = ""):
    return click.option(
        "--budget-ratio",
        type=float,  # bounded by check_arm_options, a one-line error like every refusal
        default=default,
        show_default=True,
        help=f"Budget per arm or variant as a share of the SFT warm-up's row-steps{why}.",
    )


def _options(*options):
    """Apply click options in the order given (the order --help lists them)."""

    def apply(f):
        for option in reversed(options):
            f = option(f)
        return f

    return apply


def _experiment_context(store: Store, recipe: Recipe, as_json: bool, name: str) -> tuple[Any, Any]:
    """(config, RunContext) of an experiment command. It logs its progress to stderr also with
    --json (stdout then holds only the JSON): an experiment runs for minutes to hours."""
    from pipeline.core.drafters import check_drafter_settings
    from pipeline.core.runner import RunContext

    recipe.check_prompts()
    cfg, loader = command_target(
        command_config(recipe.profile, tuple(recipe.set)), recipe.profile, tuple(recipe.set)
    )
    # Every experiment trains a warm-up drafter: its settings must not fail after the stages
    # before it ran.
    check_drafter_settings(cfg.drafter, loader.target)
    setup_logging()
    ctx = RunContext(store=store, target_loader=loader, progress=not as_json, run_name=name)
    return cfg, ctx


def _recipe_prompts(ctx: Any, recipe: Recipe, more: list[str] | None) -> Any:
    """The prompts dataset the recipe's prompts-stage overrides `more` make (None when it has
    none): run like any stage, so a second experiment finds it cached."""
    if more is None:
        return None
    from pipeline import chains

    cfg = recipe.config(*more)
    return chains.run_chain(chains.sft_chain(cfg)[:1], ctx)["prompts"].dataset


def _prompts(store: Store, ref: str | None) -> Any:
    """The prompts dataset --prompts names (None when not given); refuses another kind."""
    if not ref:
        return None
    prompts = store.open(ref)
    check_prompts_dataset(prompts, "--prompts")
    return prompts


def _command_line(store: Store, args: list[str]) -> str:
    """The command as the report quotes it (the options that were given, in canonical form)."""
    return shlex.join(["opd", "--root", str(store.root), "experiment", *args])


def _dry_run(recipe: Recipe, command: str) -> None:
    """What an experiment would run: the recipe's settings (checked) and the command."""
    recipe.check_prompts()
    lines = [f"recipe {recipe.name}: {recipe.description}", f"profile {recipe.profile}"]
    lines += [f"--set {s}" for s in recipe.set]
    for what, more in (
        ("rollout prompts", recipe.rollout_prompts),
        ("eval prompts", recipe.eval_prompts),
    ):
        if more is not None:
            lines.append(f"{what}: the prompts stage with " + " ".join(more))
    lines.append(f"would run: {command}")
    click.echo("\n".join(lines))


def _run_arms(
    store: Store,
    experiment: Callable[..., dict[str, Any]],
    args: list[str],
    options: dict[str, Any],
    recipe_fields: tuple[str, ...] = (),
    **more: Any,
) -> dict[str, Any] | None:
    """Run an experiment that trains arms or variants at a drafter budget (opd-vs-sft, ablate)
    from its recipe and `options` (the command's options: recipe_name, seeds, first_seed,
    budget, budget_ratio, prompts_ref, dry_run, as_json), quoting `args` plus them in its report, with
    the recipe's `recipe_fields` and `more` as keywords; None for a dry run."""
    name, recipe = args[0], load_recipe(options["recipe_name"])
    args = [name, "--recipe", options["recipe_name"], "--seeds", str(options["seeds"]), *args[1:]]
    if options["first_seed"] is not None:
        args += ["--first-seed", str(options["first_seed"])]
    ratio = options["budget_ratio"]
    args += ["--budget", str(options["budget"])] if options["budget"] else []
    args += [] if options["budget"] else ["--budget-ratio", f"{ratio:g}"]
    args += ["--prompts", options["prompts_ref"]] if options["prompts_ref"] else []
    if options["dry_run"]:
        return _dry_run(recipe, _command_line(store, args))
    from lab.experiments.common import WarmupPrompts

    cfg, ctx = _experiment_context(store, recipe, options["as_json"], f"experiment-{name}")
    return experiment(
        cfg,
        ctx,
        seeds=options["seeds"],
        first_seed=options["first_seed"],
        budget=options["budget"],
        budget_ratio=ratio,
        prompts=WarmupPrompts(
            _prompts(store, options["prompts_ref"]),
            _recipe_prompts(ctx, recipe, recipe.eval_prompts),
            recipe.eval_max_prompts,
            _recipe_prompts(ctx, recipe, recipe.rollout_prompts),
        ),
        command=_command_line(store, args),
        **{field: getattr(recipe, field) for field in recipe_fields},
        **more,
    )


@experiment_group.command("recipes")
@click.argument("name", required=False)
def recipes_cmd(name: str | None) -> None:
    """List the recipes, or print one: its settings, the command that reproduces its finding
    and the `opd run full` command that trains its chain."""
    if name is None:
        for n in recipe_names():
            click.echo(f"{n:24} {load_recipe(n).description}")
        return
    recipe = load_recipe(name)
    path = RECIPE_DIR / f"{recipe.name}.toml"
    click.echo(path.read_text() if path.is_file() else Path(name).read_text())
    click.echo(f"# the chain alone: {recipe.chain_command()}")


@experiment_group.command("opd-vs-sft")
@_options(_RECIPE, _seeds(3, "Seeds per arm"), _FIRST_SEED, _BUDGET, _budget_ratio(1.0))
@_options(_PROMPTS, _DRY_RUN, _JSON)
@click.pass_obj
def opd_vs_sft_cmd(store: Store, **options: Any) -> None:
    """From one SFT warm-up, spend the same drafter budget on continued SFT and on Draft-OPD
    rounds; compare tau on held-out prompts at T=0 and T=1, and plot held-out tau against
    row-steps for both arms. Writes a report dataset (experiment@VERSION).

    The budget counts drafter forward+backward row-steps (TTT-unrolled rows x steps).
    """
    from lab.experiments import opd_vs_sft

    fields = ("sft_data_temperature", "speed")
    result = _run_arms(store, opd_vs_sft.opd_vs_sft, ["opd-vs-sft"], options, fields)
    if result is not None:
        text = opd_vs_sft.summary_text(result)
        click.echo(json.dumps(result, indent=2) if options["as_json"] else text)


@experiment_group.command("ablate")
@_options(_RECIPE)
@click.option(
    "--factors",
    default="loss",
    show_default=True,
    help="Comma-separated factors to vary, one at a time around the OPD defaults: loss (every "
    "opd.loss), replays (greedy vs sampled at T=1), rounds (1-4), samples (replays per anchor "
    "at T=1: 1, 2, 4), anchors (accepted anchors per rejected one: 0, the profile's, 1), gamma "
    "(0.5, 0.8, 1.0).",
)
@click.option(
    "--levels",
    default=None,
    help='Comma-separated level labels to run, as the report names them (e.g. "accepted '
    '0x,accepted 0.1x"); default: every level of --factors.',
)
@_options(_seeds(2, "Seeds per variant"), _FIRST_SEED, _BUDGET)
@_budget_ratio(0.25, " (small: the default grid, 4 loss families x 2 seeds, then fits in an hour)")
@_options(_PROMPTS, _DRY_RUN, _JSON)
@click.pass_obj
def ablate_cmd(store: Store, factors: str, levels: str | None, **options: Any) -> None:
    """Draft-OPD variants, one factor at a time, from opd-vs-sft's SFT warm-up at one drafter
    budget; tau at T=0 and T=1 per variant over seeds. Writes a report dataset
    (experiment@VERSION: Parquet table, PNG plot, report.md).
    """
    from lab.experiments import ablate as ablation

    names = [f.strip() for f in factors.split(",") if f.strip()]
    labels = None if levels is None else [x.strip() for x in levels.split(",") if x.strip()]
    args = ["ablate", "--factors", ",".join(names)]
    args += ["--levels", ",".join(labels)] if labels is not None else []
    result = _run_arms(store, ablation.ablate, args, options, factors=names, levels=labels)
    if result is not None:
        click.echo(
            json.dumps(result, indent=2)
            if options["as_json"]
            else ablation.ablate_summary_text(result)
        )


def _numbers(ctx: click.Context, param: click.Parameter, value: str | None) -> list[float] | None:
    if value is None:
        return None
    try:
        return [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {value!r}") from None


@experiment_group.command("sft-plateau")
@_RECIPE
@click.option(
    "--data-shares",
    default="0.25,0.5,1",
    show_default=True,
    callback=_numbers,
    help="Shares of the training sequences, each trained for the recipe's epochs (or its "
    "sft.steps when set).",
)
@click.option(
    "--epochs",
    default=None,
    callback=_numbers,
    help="Epochs over all the data, one run each [default: the recipe's and twice them].",
)
@click.option(
    "--steps",
    default=None,
    callback=_numbers,
    help="For a recipe that sets sft.steps=N, the runs are sized in optimizer steps: steps over "
    "all the data, one run each [default: N and twice N].",
)
@_options(_PROMPTS, _DRY_RUN, _JSON)
@click.pass_obj
def sft_plateau_cmd(
    store: Store,
    recipe_name: str,
    data_shares: list[float],
    epochs: list[float] | None,
    steps: list[float] | None,
    prompts_ref: str | None,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Train the recipe's SFT drafter on nested shares of the data and for more epochs (or
    steps, when sft.steps is set); report teacher-forced held-out τ (T=0 and T=1) against data
    and tokens seen, and whether each axis has reached its plateau, as a report dataset with a
    plot.
    """
    from lab.experiments import sft_plateau

    recipe = load_recipe(recipe_name)
    if dry_run:
        args = ["sft-plateau", "--recipe", recipe_name]
        args += ["--data-shares", ",".join(f"{x:g}" for x in data_shares)]
        for option, values in (("--epochs", epochs), ("--steps", steps)):
            args += [option, ",".join(f"{x:g}" for x in values)] if values else []
        return _dry_run(recipe, _command_line(store, args))
    cfg, ctx = _experiment_context(store, recipe, as_json, "experiment-sft-plateau")
    result = sft_plateau.sft_plateau(
        cfg,
        ctx,
        data_shares=data_shares,
        epochs=epochs,
        steps=steps,
        plateau_gain=recipe.plateau_gain,
        prompts=_prompts(store, prompts_ref),
    )
    click.echo(json.dumps(result, indent=2) if as_json else sft_plateau.summary_text(result))


@experiment_group.command("objectives")
@_options(_RECIPE, _seeds(2, "SFT runs per objective"), _PROMPTS, _DRY_RUN, _JSON)
@click.pass_obj
def objectives_cmd(
    store: Store,
    recipe_name: str,
    seeds: int,
    prompts_ref: str | None,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Train the SFT drafter with EAGLE-3's training-time test and with EAGLE-1's objective
    (same optimizer steps over the same rows); compare tau and per-offset acceptance alpha_k
    on held-out prompts at T=0 and T=1, written as a report dataset with a plot.
    """
    from lab.experiments import objectives

    recipe = load_recipe(recipe_name)
    if dry_run:
        args = ["objectives", "--recipe", recipe_name, "--seeds", str(seeds)]
        return _dry_run(recipe, _command_line(store, args))
    cfg, ctx = _experiment_context(store, recipe, as_json, "experiment-objectives")
    result = objectives.objectives(cfg, ctx, seeds=seeds, prompts=_prompts(store, prompts_ref))
    click.echo(json.dumps(result, indent=2) if as_json else objectives.summary_text(result))


@click.command("publish")
@click.argument("source", metavar="REF|FILE.json")
@click.option("--as", "name", required=True, metavar="NAME", help="lab/published/NAME/ [required].")
@click.option("--replace", is_flag=True, help="Replace what is published as NAME.")
@click.option(
    "--command",
    default=None,
    help="For a benchmark's JSON: the command that printed it (a dataset records its own).",
)
@click.option(
    "--hardware",
    default=None,
    help="Where the report was measured [default: this machine's GPU or CPU, since a data root "
    "lives on the machine that made it].",
)
@click.pass_obj
def publish_cmd(
    store: Store,
    source: str,
    name: str,
    replace: bool,
    command: str | None,
    hardware: str | None,
) -> None:
    """Copy a report (experiment@VERSION, eval@VERSION, or a benchmark's JSON file) out of the
    data root into lab/published/NAME/ with its provenance; `python -m lab.findings` then
    renders docs/findings.md's tables from what is published."""
    dest = publish(store, source, name, replace=replace, command=command, hardware=hardware)
    click.echo(f"published {source} as {dest}")


cli.add_command(experiment_group)
cli.add_command(publish_cmd)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
