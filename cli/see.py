"""`opd see`: a shipped drafter measured here in minutes (`make see`)."""

from __future__ import annotations

from pathlib import Path

import click

from storage import OpdError, Store

BENCH = Path("../shared/data/prompts")
DEFAULT_SETS = (str(BENCH / "mt_bench.jsonl"), str(BENCH / "gsm8k.jsonl"), "humaneval")


@click.command("see")
@click.argument(
    "directory",
    type=click.Path(path_type=Path, file_okay=False),
    default=Path("assets/smollm2/eagle3"),
)
@click.option(
    "--sets",
    "sets_",
    multiple=True,
    default=DEFAULT_SETS,
    show_default=True,
    help="Held-out sets: question.jsonl files (MT-Bench, GSM8K) or humaneval (repeatable).",
)
@click.option("--prompts-per-set", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option(
    "--tune-prompts",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Prompts per set `opd tune` times K on (once per drafter and machine: recorded).",
)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="e.g. target.dtype=float32")
@click.option(
    "--json",
    "json_out",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Also write the result here as JSON (for `opd publish FILE.json --as NAME`).",
)
@click.pass_obj
def see_cmd(
    store: Store,
    directory: Path,
    sets_: tuple[str, ...],
    prompts_per_set: int,
    max_new_tokens: int,
    tune_prompts: int,
    sets: tuple[str, ...],
    json_out: Path | None,
) -> None:
    """Import the drafter in DIRECTORY (an `opd export` directory; default: the committed
    SmolLM2 EAGLE-3 drafter) and decode held-out prompts with it at the K `opd tune` measures
    fastest here, beside plain decoding and the n-gram lookup (batch 1, T=0): τ over every
    verify step, speed-up, outputs identical to plain decoding; then the `vllm serve` command."""
    from collections import Counter

    import torch

    from cli.common import recorded_target, setup_logging
    from pipeline.core.drafter_import import describe, import_drafter
    from pipeline.core.drafter_import import recorded_target as drafter_target
    from pipeline.core.drafters import load_drafter_dataset
    from pipeline.core.export import vllm_command
    from pipeline.core.quicklook import (
        cpu_name,
        lookup_drafter,
        side_by_side,
        summary,
        table,
        write_report,
    )
    from pipeline.core.targets import TargetLoader, resolve_dtype
    from pipeline.core.tuning import (
        k_report,
        quick_options,
        run_tune,
        serving_k,
        trained_k,
        tuned_result,
    )
    from pipeline.profiles import load_config
    from pipeline.stages.prompts import PromptsConfig, heldout_rows, heldout_set_name

    missing = [s for s in sets_ if s != "humaneval" and not Path(s).is_file()]
    if missing:
        raise OpdError(
            f"held-out set {missing[0]} is not a file: pass --sets PATH/mt_bench.jsonl (EAGLE's "
            "question.jsonl files) or --sets humaneval"
        )
    setup_logging()
    cfg = load_config("default", None, list(sets))
    target_cfg = recorded_target(drafter_target(describe(directory)), None, sets, str(directory))
    loader = TargetLoader(target_cfg)
    ds, _ = import_drafter(store, directory, loader)
    target, tok = loader.target, loader.tokenizer
    # the held-out rows the prompts stage makes (smollm2 profile's prompt cap: HumanEval's
    # longer functions stay in)
    pcfg = PromptsConfig(
        source="magpie",
        heldout_sets=list(sets_),
        max_heldout_rows=prompts_per_set,
        max_prompt_tokens=load_config("smollm2").prompts.max_prompt_tokens,
    )
    rows = heldout_rows(pcfg, tok, Counter())
    prompts: dict[str, list[list[int]]] = {}
    for row in rows:
        prompts.setdefault(row["source"].split(":")[0], []).append(list(row["prompt_ids"]))
    names = [heldout_set_name(s) for s in sets_]

    trained = trained_k(ds) or cfg.drafting.k
    if tuned_result(ds, 0.0) is None:
        subset = [p for set_rows in prompts.values() for p in set_rows[:tune_prompts]]
        click.echo(f"opd tune: timing K=1..{trained} on {len(subset)} prompts ...")
        run_tune(ds, subset, loader, 0.0, trained, quick_options(max_new_tokens))
    k, _ = serving_k(ds, 0.0, trained)
    drafter = load_drafter_dataset(ds, target, loader.identity)
    title, lookup = lookup_drafter(target)
    n = sum(len(v) for v in prompts.values())
    click.echo(f"decoding {n} prompts x {max_new_tokens} new tokens, batch 1, T=0 ...")
    tallies = side_by_side(
        target, {"drafter": (drafter, k), "lookup": (lookup, trained)}, prompts, max_new_tokens
    )
    dtype = resolve_dtype(loader.cfg)
    click.echo(f"CPU {cpu_name()}, target dtype {dtype}, "
               f"{torch.get_num_threads()} torch thread(s)")  # fmt: skip
    click.echo(f"drafter {ds.ref} from {directory}: {drafter.spec.title}")
    click.echo(f"draft length {k_report(ds, k)}")
    labels = {"plain": "plain decoding", "drafter": f"{drafter.spec.title} K={k}"}
    labels["lookup"] = f"{title} K={trained}"
    for line in table(tallies, labels, names, dtype):
        click.echo("  " + line)
    if json_out is not None:
        facts = {"drafter": str(ds.ref), "drafter_kind": drafter.spec.name, "k": k}
        facts |= {"trained_k": trained, "k_report": k_report(ds, k), "directory": str(directory)}
        facts |= {"prompts_per_set": prompts_per_set, "max_new_tokens": max_new_tokens}
        facts |= {"dtype": dtype, "threads": torch.get_num_threads()}
        write_report(json_out, facts, summary(tallies, labels, names), names)
    served = drafter.speculative_config(directory.resolve(), k)
    click.echo("serve it with:")
    click.echo(f"  {vllm_command(str(loader.directory or '<target-model-dir>'), served)}")
