"""`opd experiment ...`: the studies comparing Draft-OPD with continued SFT, losses and objectives.

The `opd` command is the product's command group (cli.main) plus this one: the lab imports the
product, never the other way round, so the product runs and installs its commands without it.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

import click

from cli.common import check_prompts_dataset, command_config, command_target, setup_logging
from cli.main import cli
from models.drafters import DEFAULT_KIND, KINDS
from storage import Store


@click.group("experiment")
def experiment_group() -> None:
    """Experiments that compare training methods end to end."""


_PROFILE = click.option(
    "--profile", default="default", show_default=True, help="Config profile (tiny, default)."
)
_SETS = click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override one config value (repeatable).",
)
_BUDGET = click.option(
    "--budget",
    type=click.IntRange(min=1),
    default=None,
    help="Drafter row-steps per arm or variant [default: --budget-ratio x the warm-up's].",
)
_PROMPTS = click.option(
    "--prompts",
    "prompts_ref",
    default=None,
    help="Use this prompts dataset instead of running the prompts stage.",
)
_ROLLOUT_PROMPTS = click.option(
    "--rollout-prompts",
    "rollout_prompts_ref",
    default=None,
    help="Draft-OPD's rollouts (and continued SFT's fresh sequences) draw on this prompts "
    "dataset's train split, prompts the warm-up never trained on (e.g. made by the prompts "
    "stage with another prompts.seed) [default: the warm-up prompts'].",
)
_DRAFTER_KIND = click.option(
    "--drafter-kind",
    type=click.Choice(list(KINDS)),
    default=DEFAULT_KIND,
    show_default=True,
    help="The student every arm or variant trains (drafter.kind): "
    + ", ".join(f"{s.name} ({s.title})" for s in KINDS.values())
    + ".",
)
_EVAL_PROMPTS = click.option(
    "--eval-prompts",
    "eval_prompts_ref",
    default=None,
    help="Evaluate tau on this prompts dataset's held-out split, per set (e.g. one made with "
    "--set prompts.heldout_sets=[mt_bench,gsm8k,humaneval]) [default: the warm-up prompts']. "
    "The teacher-forced held-out curve stays on the warm-up prompts' own split, so adding it "
    "later retrains nothing.",
)
_EVAL_MAX_PROMPTS = click.option(
    "--eval-max-prompts",
    type=click.IntRange(min=1),
    default=None,
    help="Prompts per held-out set that every evaluation decodes [default: evaluate.max_prompts, "
    "which also sizes the held-out validation sequences: changing that one retrains the arms].",
)
_FIRST_SEED = click.option(
    "--first-seed",
    type=int,  # bounded by check_arm_options, a one-line error like every refusal
    default=None,
    help="First seed of the arms or variants [default: sft.seed]; the warm-up keeps sft.seed, "
    "so processes running disjoint seeds share it.",
)
_JSON = click.option("--json", "as_json", is_flag=True, help="Print the whole result as JSON.")


def _options(*options):
    """Apply click options in the order given (the order --help lists them)."""

    def apply(f):
        for option in reversed(options):
            f = option(f)
        return f

    return apply


_experiment_options = _options(_PROFILE, _SETS, _BUDGET, _PROMPTS, _JSON)
"""The options of the experiments that train arms or variants at a drafter budget."""
_sft_experiment_options = _options(_PROFILE, _SETS, _PROMPTS, _JSON)
"""The options of the experiments that compare SFT runs (no budget: they train SFT's own)."""


def _experiment_context(
    store: Store,
    profile: str,
    sets: tuple[str, ...],
    as_json: bool,
    name: str,
    datasets: tuple[Any, ...] = (),
) -> tuple[Any, Any]:
    """(config, RunContext) of an experiment command. It logs its progress to stderr also with
    --json (stdout then holds only the JSON): an experiment runs for minutes to hours.
    `datasets`: existing datasets it reads (None: an option not given), which must have been made
    with its target."""
    from pipeline.core.drafters import check_drafter_settings
    from pipeline.core.runner import RunContext

    given = tuple(d for d in datasets if d is not None)
    cfg, loader = command_target(command_config(profile, sets), profile, sets, given)
    # Every experiment trains a warm-up drafter: its settings must not fail after the stages
    # before it ran.
    check_drafter_settings(cfg.drafter, loader.target)
    setup_logging()
    ctx = RunContext(store=store, target_loader=loader, progress=not as_json, run_name=name)
    return cfg, ctx


def _prompts_option(store: Store, ref: str | None, option: str) -> Any:
    """The prompts dataset an option names (None when not given); refuses another kind."""
    if not ref:
        return None
    prompts = store.open(ref)
    check_prompts_dataset(prompts, option)
    return prompts


def _command_line(store: Store, args: list[str]) -> str:
    """The command as the report quotes it (the options that were given, in canonical form)."""
    return shlex.join(["opd", "--root", str(store.root), "experiment", *args])


def _with_drafter_kind(sets: tuple[str, ...], kind: str) -> tuple[str, ...]:
    """`sets` with drafter.kind=KIND (EAGLE-3, the default, adds nothing, so its versions and
    quoted command stay what they were); refuses a --set that names another kind."""
    given = [s.split("=", 1)[1] for s in sets if s.split("=", 1)[0].strip() == "drafter.kind"]
    if any(g != kind for g in given):
        raise click.UsageError(
            f"--drafter-kind {kind} but --set drafter.kind={given[0]}: name the kind once"
        )
    return sets if kind == DEFAULT_KIND or given else (*sets, f"drafter.kind={kind}")


@experiment_group.command("opd-vs-sft")
@_experiment_options
@_ROLLOUT_PROMPTS
@click.option(
    "--seeds",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Seeds per arm (mean and spread over them).",
)
@_FIRST_SEED
@click.option(
    "--budget-ratio",
    type=float,  # bounded by check_arm_options, a one-line error like every refusal
    default=1.0,
    show_default=True,
    help="Budget per arm as a share of the SFT warm-up's row-steps.",
)
@_DRAFTER_KIND
@click.option(
    "--sft-data-temperature",
    type=float,
    default=None,
    help="Sample the fresh target sequences continued SFT trains on at this temperature "
    "[default: the OPD rollouts' temperature].",
)
@click.option(
    "--speed",
    is_flag=True,
    help="Also time the first seed's warm-up, continued-SFT and Draft-OPD drafters against "
    "plain decoding on the held-out prompts, side by side, into the report.",
)
@_EVAL_PROMPTS
@_EVAL_MAX_PROMPTS
@click.pass_obj
def opd_vs_sft_cmd(
    store: Store,
    profile: str,
    sets: tuple[str, ...],
    seeds: int,
    first_seed: int | None,
    budget: int | None,
    budget_ratio: float,
    drafter_kind: str,
    sft_data_temperature: float | None,
    speed: bool,
    eval_prompts_ref: str | None,
    eval_max_prompts: int | None,
    prompts_ref: str | None,
    rollout_prompts_ref: str | None,
    as_json: bool,
) -> None:
    """From one SFT warm-up, spend the same drafter budget on continued SFT and on Draft-OPD
    rounds; compare tau on held-out prompts at T=0 and T=1, and plot held-out tau against
    row-steps for both arms. Writes a report dataset (experiment@VERSION).

    The budget counts drafter forward+backward row-steps (TTT-unrolled rows x steps).
    """
    from lab.experiments import opd_vs_sft

    sets = _with_drafter_kind(sets, drafter_kind)
    eval_prompts = _prompts_option(store, eval_prompts_ref, "--eval-prompts")
    rollout_prompts = _prompts_option(store, rollout_prompts_ref, "--rollout-prompts")
    cfg, ctx = _experiment_context(
        store,
        profile,
        sets,
        as_json,
        "experiment-opd-vs-sft",
        (eval_prompts, rollout_prompts),
    )
    args = ["opd-vs-sft", "--profile", profile, *(f"--set={s}" for s in sets)]
    args += ["--seeds", str(seeds)]
    args += ["--first-seed", str(first_seed)] if first_seed is not None else []
    args += ["--budget", str(budget)] if budget else ["--budget-ratio", f"{budget_ratio:g}"]
    if sft_data_temperature is not None:
        args += ["--sft-data-temperature", f"{sft_data_temperature:g}"]
    args += ["--prompts", prompts_ref] if prompts_ref else []
    args += ["--eval-prompts", eval_prompts_ref] if eval_prompts_ref else []
    args += ["--rollout-prompts", rollout_prompts_ref] if rollout_prompts_ref else []
    args += ["--eval-max-prompts", str(eval_max_prompts)] if eval_max_prompts else []
    args += ["--speed"] if speed else []
    result = opd_vs_sft.opd_vs_sft(
        cfg,
        ctx,
        seeds=seeds,
        first_seed=first_seed,
        budget=budget,
        budget_ratio=budget_ratio,
        sft_data_temperature=sft_data_temperature,
        prompts=store.open(prompts_ref) if prompts_ref else None,
        eval_prompts=eval_prompts,
        eval_max_prompts=eval_max_prompts,
        rollout_prompts=rollout_prompts,
        command=_command_line(store, args),
        speed=speed,
    )
    click.echo(json.dumps(result, indent=2) if as_json else opd_vs_sft.summary_text(result))


@experiment_group.command("ablate")
@_experiment_options
@_ROLLOUT_PROMPTS
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
    '0x,accepted 0.1x"); default: every level of --factors. For a machine that has time for '
    "some levels: the report covers the levels run.",
)
@click.option(
    "--seeds",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Seeds per variant (mean and spread over them).",
)
@_FIRST_SEED
@click.option(
    "--budget-ratio",
    type=float,  # bounded by check_arm_options, a one-line error like every refusal
    default=0.25,
    show_default=True,
    help="Budget per variant as a share of the SFT warm-up's row-steps (small, so the default "
    "grid, 4 loss families x 2 seeds, takes an estimated 40 min on the default profile).",
)
@_DRAFTER_KIND
@_EVAL_PROMPTS
@_EVAL_MAX_PROMPTS
@click.pass_obj
def ablate_cmd(
    store: Store,
    profile: str,
    sets: tuple[str, ...],
    factors: str,
    levels: str | None,
    seeds: int,
    first_seed: int | None,
    budget: int | None,
    budget_ratio: float,
    drafter_kind: str,
    eval_prompts_ref: str | None,
    eval_max_prompts: int | None,
    prompts_ref: str | None,
    rollout_prompts_ref: str | None,
    as_json: bool,
) -> None:
    """Draft-OPD variants, one factor at a time, from opd-vs-sft's SFT warm-up at one drafter
    budget; tau at T=0 and T=1 per variant over seeds. Writes a report dataset
    (experiment@VERSION: Parquet table, PNG plot, report.md).
    """
    from lab.experiments import ablate as ablation

    names = [f.strip() for f in factors.split(",") if f.strip()]
    labels = None if levels is None else [x.strip() for x in levels.split(",") if x.strip()]
    sets = _with_drafter_kind(sets, drafter_kind)
    eval_prompts = _prompts_option(store, eval_prompts_ref, "--eval-prompts")
    rollout_prompts = _prompts_option(store, rollout_prompts_ref, "--rollout-prompts")
    cfg, ctx = _experiment_context(
        store,
        profile,
        sets,
        as_json,
        "experiment-ablate",
        (eval_prompts, rollout_prompts),
    )
    args = ["ablate", "--profile", profile, *(f"--set={s}" for s in sets)]
    args += ["--factors", ",".join(names), "--seeds", str(seeds)]
    args += ["--levels", ",".join(labels)] if labels is not None else []
    args += ["--first-seed", str(first_seed)] if first_seed is not None else []
    args += ["--budget", str(budget)] if budget else ["--budget-ratio", f"{budget_ratio:g}"]
    args += ["--prompts", prompts_ref] if prompts_ref else []
    args += ["--eval-prompts", eval_prompts_ref] if eval_prompts_ref else []
    args += ["--rollout-prompts", rollout_prompts_ref] if rollout_prompts_ref else []
    args += ["--eval-max-prompts", str(eval_max_prompts)] if eval_max_prompts else []
    result = ablation.ablate(
        cfg,
        ctx,
        factors=names,
        levels=labels,
        seeds=seeds,
        first_seed=first_seed,
        budget=budget,
        budget_ratio=budget_ratio,
        prompts=store.open(prompts_ref) if prompts_ref else None,
        eval_prompts=eval_prompts,
        eval_max_prompts=eval_max_prompts,
        rollout_prompts=rollout_prompts,
        command=_command_line(store, args),
    )
    click.echo(json.dumps(result, indent=2) if as_json else ablation.ablate_summary_text(result))


def _numbers(ctx: click.Context, param: click.Parameter, value: str | None) -> list[float] | None:
    if value is None:
        return None
    try:
        return [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {value!r}") from None


@experiment_group.command("sft-plateau")
@_sft_experiment_options
@click.option(
    "--data-shares",
    default="0.25,0.5,1",
    show_default=True,
    callback=_numbers,
    help="Shares of the training sequences, each trained for the profile's epochs (or its "
    "sft.steps when set).",
)
@click.option(
    "--epochs",
    default=None,
    callback=_numbers,
    help="Epochs over all the data, one run each [default: the profile's and twice them].",
)
@click.option(
    "--steps",
    default=None,
    callback=_numbers,
    help="With --set sft.steps=N, the runs are sized in optimizer steps: steps over all the "
    "data, one run each [default: N and twice N].",
)
@click.option(
    "--plateau-gain",
    type=click.FloatRange(min=0),
    default=0.01,
    show_default=True,
    help="An axis is at its plateau when its last step up raised τ by less than this.",
)
@click.pass_obj
def sft_plateau_cmd(
    store: Store,
    profile: str,
    sets: tuple[str, ...],
    data_shares: list[float],
    epochs: list[float] | None,
    steps: list[float] | None,
    plateau_gain: float,
    prompts_ref: str | None,
    as_json: bool,
) -> None:
    """Train the profile's SFT drafter on nested shares of the data and for more epochs (or
    steps, when sft.steps is set); report teacher-forced held-out τ (T=0 and T=1) against data
    and tokens seen, and whether each axis has reached its plateau, as a report dataset with a
    plot.
    """
    from lab.experiments import sft_plateau

    cfg, ctx = _experiment_context(store, profile, sets, as_json, "experiment-sft-plateau")
    result = sft_plateau.sft_plateau(
        cfg,
        ctx,
        data_shares=data_shares,
        epochs=epochs,
        steps=steps,
        plateau_gain=plateau_gain,
        prompts=store.open(prompts_ref) if prompts_ref else None,
    )
    click.echo(json.dumps(result, indent=2) if as_json else sft_plateau.summary_text(result))


@experiment_group.command("objectives")
@_sft_experiment_options
@click.option(
    "--seeds",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="SFT runs per objective (mean and spread over them).",
)
@click.pass_obj
def objectives_cmd(
    store: Store,
    profile: str,
    sets: tuple[str, ...],
    seeds: int,
    prompts_ref: str | None,
    as_json: bool,
) -> None:
    """Train the SFT drafter with EAGLE-3's training-time test and with EAGLE-1's objective
    (same optimizer steps over the same rows); compare tau and per-offset acceptance alpha_k
    on held-out prompts at T=0 and T=1, written as a report dataset with a plot.
    """
    from lab.experiments import objectives

    cfg, ctx = _experiment_context(store, profile, sets, as_json, "experiment-objectives")
    result = objectives.objectives(
        cfg, ctx, seeds=seeds, prompts=store.open(prompts_ref) if prompts_ref else None
    )
    click.echo(json.dumps(result, indent=2) if as_json else objectives.summary_text(result))


cli.add_command(experiment_group)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
