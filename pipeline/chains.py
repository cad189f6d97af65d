"""Which stages a chain runs, in what order, and which step's output feeds which input.

The wiring is data (a list of `Step`s) so the plain-Python runner here and the Prefect flow
in flows/ execute exactly the same chain: the flow only wraps each step in a task.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from models.drafters import kind_spec
from pipeline import stages
from pipeline.core.config import StrictConfig, is_lossy
from pipeline.core.drafters import drafter_kind, needs_training, refuse_untrained
from pipeline.core.export import EXPORTS_DIR, export_drafter
from pipeline.core.runner import RunContext, StageResult, run_stage
from pipeline.core.stage import Stage
from pipeline.core.targets import TargetLoader, check_engine_target
from pipeline.core.tuning import (
    heldout_prompts,
    quick_options,
    run_tune,
    serving_k,
    trained_k,
    tuned_result,
)
from pipeline.profiles import PipelineConfig
from storage import Dataset, OpdError

log = logging.getLogger("opd")


@dataclass
class Step:
    key: str  # unique within the chain; also the config section for single-stage runs
    stage: Stage
    cfg: StrictConfig
    inputs: dict[str, str] = field(default_factory=dict)  # role -> key of an earlier step


ON_THE_TARGETS_LAW = ("rollout", "score")
"""Stages whose outputs must have the target's law (its samples, its scores of the drafts they
replay): Draft-OPD trains on them, so a lossy verifier would teach the drafter another law."""


def _step(key: str, cfg: PipelineConfig, inputs: dict[str, str] | None = None, **update) -> Step:
    """Step `key` of stage `key` (or `<stage>-r<round>`), its config section updated by `update`."""
    stage = stages.get(key.partition("-r")[0])
    if stage.name in ON_THE_TARGETS_LAW and cfg.drafting.acceptance == "typical":
        raise OpdError(
            f"{stage.name} must keep the target's law, and drafting.acceptance=typical is lossy: "
            "drop it for this run (typical acceptance is for evaluate only)"
        )
    section = getattr(cfg, stage.name)
    check_engine_target(stage.name, section, cfg.target)
    return Step(key, stage, section.model_copy(update=update) if update else section, inputs or {})


def single_step(name: str, cfg: PipelineConfig) -> Step:
    """One stage by name; `rollout-r2` etc. is that round's stage (its config with round=2)."""
    stage, _, suffix = name.partition("-r")
    if stage in stages.BY_NAME and stages.BY_NAME[stage].per_round:
        if suffix.isdigit() and int(suffix) >= 1:
            return _step(name, cfg, round=int(suffix))
    if name not in stages.BY_NAME:
        rounds = [s.name for s in stages.STAGES if s.per_round]
        raise OpdError(
            f"unknown stage {name!r}; stages: {', '.join(stages.BY_NAME)} (round stages "
            f"{', '.join(rounds)} also as e.g. {rounds[0]}-r1); chains: {', '.join(CHAINS)}"
        )
    return _step(name, cfg)


def sft_chain(cfg: PipelineConfig) -> list[Step]:
    return [
        _step("prompts", cfg),
        # with a source file, generate reads no prompts (the chain still makes them: evaluate's)
        _step("generate", cfg, {} if cfg.generate.source else {"prompts": "prompts"}),
        _step("features", cfg, {"trajectories": "generate"}),
        _step("sft", cfg, {"features": "features"}),
        _step("evaluate", cfg, {"prompts": "prompts", "drafter": "sft"}),
    ]


def opd_rounds(cfg: PipelineConfig, drafter: str = "sft", first: int = 1) -> list[Step]:
    """Rounds first..cfg.rounds of rollout -> score -> opd, starting from step `drafter`'s output.

    Steps read `prompts` and, with the features anchor on, `features` from earlier steps.
    """
    steps: list[Step] = []
    if cfg.rounds >= first:
        refuse_untrained(cfg.drafter.kind, "Draft-OPD (rounds of rollout, score and opd)")
    for r in range(first, cfg.rounds + 1):
        opd_inputs = {"replays": f"score-r{r}", "rollouts": f"rollout-r{r}", "drafter": drafter}
        if cfg.opd.ce_lambda > 0 and cfg.opd.ce_source == "features":
            opd_inputs["features"] = "features"
        steps += [
            _step(f"rollout-r{r}", cfg, {"prompts": "prompts", "drafter": drafter}, round=r),
            _step(f"score-r{r}", cfg, {"rollouts": f"rollout-r{r}", "drafter": drafter}, round=r),
            _step(f"opd-r{r}", cfg, opd_inputs, round=r),
        ]
        drafter = f"opd-r{r}"
    return steps


def full_chain(cfg: PipelineConfig) -> list[Step]:
    """prompts -> generate -> features -> sft -> [rollout-rN -> score-rN -> opd-rN] x rounds -> evaluate."""
    rounds = opd_rounds(cfg)
    final = rounds[-1].key if rounds else "sft"
    # The export of `final` is not a dataset stage: the CLI and the flow run it after the chain.
    return [
        *sft_chain(cfg)[:-1],
        *rounds,
        _step("evaluate", cfg, {"prompts": "prompts", "drafter": final}),
    ]


CHAINS: dict[str, Callable[[PipelineConfig], list[Step]]] = {
    "sft-chain": sft_chain,
    "full": full_chain,
}

Execute = Callable[[Step, dict[str, Dataset]], StageResult]


def record_results(ctx: RunContext, run_name: str, results: dict[str, StageResult]) -> None:
    """Remember what a named run produced: by step key, and by dataset name (last one wins)."""
    produced: dict[str, str] = {}
    for key, r in results.items():
        if r.dataset is not None:
            produced[key] = produced[r.ref.name] = str(r.ref)
    ctx.store.record_run(run_name, produced)


def run_chain(
    steps: list[Step],
    ctx: RunContext,
    *,
    external: dict[str, Dataset] | None = None,
    execute: Execute | None = None,
    force: set[str] = frozenset(),
) -> dict[str, StageResult]:
    """Run steps in order; a step's inputs come from earlier steps or `external` datasets."""
    results: dict[str, StageResult] = {}
    available: dict[str, Dataset] = dict(external or {})

    def default_execute(step: Step, inputs: dict[str, Dataset]) -> StageResult:
        return run_stage(step.stage, step.cfg, inputs, ctx, force=step.key in force)

    execute = execute or default_execute
    for step in steps:
        inputs = {}
        for role, source in step.inputs.items():
            if source in results:
                inputs[role] = results[source].dataset
            elif source in available:
                inputs[role] = available[source]
            else:
                raise OpdError(
                    f"step {step.key!r} needs {role!r} from {source!r}, which has not run"
                )
        results[step.key] = execute(step, inputs)
    return results


def summary_markdown(results: dict[str, StageResult]) -> str:
    """A markdown table of what each step produced, with τ where a step measured it."""
    lines = ["| step | dataset | status | τ |", "|---|---|---|---|"]
    for key, r in results.items():
        tau = r.dataset.meta.get("tau") if r.dataset is not None else None
        status = "cached" if r.reused else f"ran {r.seconds:.0f}s"
        tau_s = f"{tau:.3f}" if isinstance(tau, int | float) else ""
        if r.dataset is not None and is_lossy(r.dataset.meta):
            tau_s += " LOSSY (typical acceptance)"
        lines.append(f"| {key} | `{r.ref}` | {status} | {tau_s} |")
    return "\n".join(lines)


def export_chain_result(results: dict, loader: TargetLoader, root: Path, k: int) -> dict | None:
    """The `export` step of the full chain: the last drafter a chain produced, in every format
    of its kind, under <root>/_exports/<NAME-VERSION>/<format> (replaced when the chain runs
    again). Returns the first format's info plus `formats` (None: no drafter)."""
    drafters = [
        r.dataset
        for r in results.values()
        if r.dataset is not None and r.ref.name in ("sft", "opd")
    ]
    if not drafters:
        return None
    last = drafters[-1]
    base = root / EXPORTS_DIR / str(last.ref).replace("@", "-")
    formats = kind_spec(drafter_kind(last)).export_formats
    if not formats:  # a kind that is not served: nothing to export
        return None
    infos = [export_drafter(last, loader, f, base / f, k, overwrite=True) for f in formats]
    return infos[0] | {"formats": list(formats)}


TUNE_PROMPTS = 3
"""Held-out prompts the chain's final drafter is tuned on (`opd see` tunes on one per set): the
tuning only ranks a few K against each other; the evaluation at the chosen K measures it."""


def tuned_evaluation(
    results: dict[str, StageResult], ctx: RunContext, cfg: PipelineConfig
) -> StageResult | None:
    """The chain's final evaluation again at the K `opd tune` measures fastest on this machine,
    tuning the final drafter first (at the evaluation's temperature) unless it was. None when
    the final evaluation already decoded at that K, or when nothing is served at a tuned K: no
    evaluation, a drafter that learns nothing (prompt lookup), draft trees or typical
    acceptance (vLLM serves fixed-K chains, losslessly)."""
    final = results.get("evaluate")
    if final is None or final.dataset is None or "k" not in final.dataset.meta:
        return None
    if cfg.drafting.tree is not None or cfg.drafting.acceptance == "typical":
        return None
    drafter = ctx.store.open(final.dataset.inputs["drafter"])
    if not needs_training(drafter_kind(drafter)):
        return None
    prompts = ctx.store.open(final.dataset.inputs["prompts"])
    evaluated, temperature = final.dataset.meta["k"], cfg.evaluate.temperature
    if tuned_result(drafter, temperature) is None:
        tune_on = heldout_prompts(prompts, cfg.evaluate.split, TUNE_PROMPTS)
        opts = quick_options(cfg.evaluate.max_new_tokens)
        log.info("[evaluate] timing K=1..%d on %d prompts (opd tune)", evaluated, len(tune_on))
        run_tune(drafter, tune_on, ctx.target_loader, temperature, evaluated, opts)
    k, _ = serving_k(drafter, temperature, evaluated)
    if k == evaluated:
        return None
    # The n-gram lookup and the untrained contrast are the final evaluation's, on these prompts.
    step = _step("evaluate", cfg, k=k, free_baseline=False, untrained_contrast=False)
    tuned = run_stage(step.stage, step.cfg, {"prompts": prompts, "drafter": drafter}, ctx)
    ctx.store.set_latest(final.ref)  # eval@latest stays the chain's own, the lookup beside it
    return tuned


def final_report(evaluation: Dataset, tuned: Dataset | None, machine: str) -> list[str]:
    """The chain's final evaluation as a user compares it, on `machine` (its CPU or GPU and the
    target's dtype): the drafter at its trained K and at the K `opd tune` measured fastest here
    (`tuned`: its evaluation at that K, None when the final evaluation decoded at it), and the
    n-gram lookup on the same prompts: τ over every verify step and the speed-up over plain
    decoding timed beside each."""
    meta = evaluation.meta
    drafter = evaluation.store.open(meta["drafter"])
    title = kind_spec(drafter_kind(drafter)).title
    entry = tuned_result(drafter, meta["temperature"])
    ks = {"trained": trained_k(drafter), "opd tune's": entry["serve"]["k"] if entry else None}
    rows = []
    for m in (meta, *((tuned.meta,) if tuned is not None else ())):
        notes = " and ".join(name for name, k in ks.items() if k == m["k"])
        rows.append((f"{title} K={m['k']}" + (f" ({notes} K)" if notes else ""), m))
    if (free := meta.get("free_baseline")) is not None:
        rows.append((f"{free.get('title', free.get('kind'))} K={meta['k']}", free))
    width = max(len(label) for label, _ in rows)
    lines = [
        f"final evaluation, T={meta['temperature']:g}, {meta['prompts']} held-out prompts, "
        f"batch 1, {machine}:"
    ]
    for label, m in rows:
        speed = f", {m['speedup']:.2f}x plain decoding" if "speedup" in m else ""
        lines.append(f"  {label:<{width}}  tau {m['tau']:.3f}{speed}")
    return lines
