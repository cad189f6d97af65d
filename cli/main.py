"""`opd`: the command line.

Every command takes the data root from `--root` or `OPD_HOME` (default ./opd-data). User
errors print one line, `error: ...`, and exit 2; nothing is written.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from storage import OpdError, Store, check_run_name, default_root

if TYPE_CHECKING:
    from pipeline.distributed import Ranks
    from pipeline.profiles import PipelineConfig

_PROFILE_HELP = (
    "Config profile [default: the target the input datasets were made with, else 'default']."
)


def _human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError


class _Group(click.Group):
    """Turns user errors into one-line messages instead of tracebacks."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except OpdError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--root",
    type=click.Path(path_type=Path),
    default=None,
    help="Data root holding all datasets [env OPD_HOME; default ./opd-data].",
)
@click.pass_context
def cli(ctx: click.Context, root: Path | None) -> None:
    """Draft-OPD: train speculative-decoding drafters as versioned, resumable stages.

    Datasets are referenced as NAME@VERSION, NAME@latest (or just NAME) and NAME@run:RUN.
    """
    ctx.obj = Store(root if root is not None else default_root())


@cli.command("ls")
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_obj
def ls_cmd(store: Store, name: str | None, as_json: bool) -> None:
    """List datasets and their versions (complete or not, rows, bytes)."""
    rows = store.listing(name)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo(f"no datasets under {store.root}")
        return
    click.echo(f"{'dataset':<28} {'state':<10} {'rows':>8} {'bytes':>10}  created")
    for r in rows:
        ref = f"{r['name']}@{r['version']}" + (" *" if r["latest"] else "")
        state = "complete" if r["complete"] else "INCOMPLETE"
        rows_s = "-" if r["rows"] is None else str(r["rows"])
        click.echo(
            f"{ref:<28} {state:<10} {rows_s:>8} {_human_bytes(r['bytes']):>10}  {r['created'] or '-'}"
        )
    click.echo("(* = latest)")


def _print_tree(node: dict[str, Any], indent: str = "", role: str = "") -> None:
    label = f"{role}: " if role else ""
    extra = " (missing)" if node.get("missing") else f"  [{node.get('stage')}]"
    click.echo(f"{indent}{label}{node['ref']}{extra}")
    for r, child in node.get("inputs", {}).items():
        _print_tree(child, indent + "  ", r)


@cli.command("show")
@click.argument("ref")
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
@click.option("--verify", is_flag=True, help="Checksum every shard now.")
@click.pass_obj
def show_cmd(store: Store, ref: str, as_json: bool, verify: bool) -> None:
    """Show a dataset's manifest and its lineage back to the prompts."""
    ds = store.open(ref)
    if verify:
        ds.verify_all(rehash=True)
    if as_json:
        click.echo(json.dumps(ds.manifest | {"lineage": store.lineage(ds.ref)}, indent=2))
        return
    m = ds.manifest
    prov = m["provenance"]
    git = prov["git"]
    click.echo(f"{ds.ref}  stage={m['stage']} v{m['stage_version']}")
    click.echo(f"  path:      {ds.path}")
    click.echo(f"  rows:      {m['rows']}   bytes: {_human_bytes(m['bytes'])}")
    click.echo(f"  shards:    {len(m['shards'])}" + ("  (all verified)" if verify else ""))
    click.echo(f"  created:   {prov['committed_at']}   by: {' '.join(prov['command'])}")
    dirty = " (dirty)" if git.get("dirty") else ""
    click.echo(f"  code:      {git.get('sha') or 'not a git checkout'}{dirty}")
    click.echo("  config:    " + json.dumps(m["config"], sort_keys=True))
    if m.get("meta"):
        click.echo("  meta:      " + json.dumps(m["meta"], sort_keys=True)[:2000])
    click.echo("lineage:")
    _print_tree(store.lineage(ds.ref), "  ")


@cli.command("gc")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@click.pass_obj
def gc_cmd(store: Store, dry_run: bool) -> None:
    """Remove incomplete datasets and stale temporaries (never a complete dataset)."""
    removed = store.gc(dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    for p in removed:
        click.echo(f"{verb} {p}")
    click.echo(f"{verb} {len(removed)} path(s)")


def _setup_logging(prefix: str = "") -> None:
    import logging

    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {prefix}%(message)s", datefmt="%H:%M:%S"
    )


class _RunCommand(click.Command):
    """`opd run --help` lists the stages from their records (imported only for help)."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from pipeline.chains import CHAINS
        from pipeline.stages import STAGES

        rows = []
        for s in STAGES:
            reads = ", ".join(f"{r}<-{'|'.join(k)}" for r, k in s.inputs.items()) or "-"
            rounds = f" (also {s.name}-rN)" if s.per_round else ""
            rows.append((s.name + rounds, f"{s.doc}; reads {reads}; writes {s.output}"))
        with formatter.section("Stages"):
            formatter.write_dl(rows)
        with formatter.section("Chains"):
            formatter.write_text(", ".join(CHAINS))


@cli.command("run", cls=_RunCommand)
@click.argument("stage")
@click.option(
    "--profile",
    default=None,
    help="Config profile (tiny, default) [default: default; a single stage takes its target from its inputs].",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, exists=True),
    help="JSON config applied over the profile.",
)
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override one config value, e.g. --set sft.lr=1e-3 (repeatable).",
)
@click.option(
    "--input",
    "input_refs",
    multiple=True,
    metavar="ROLE=REF",
    help="Use this dataset for an input role instead of the latest (repeatable).",
)
@click.option(
    "--force", is_flag=True, help="Recompute the stage's output even if its version exists."
)
@click.option(
    "--run-name",
    default="default",
    show_default=True,
    help="Record produced versions under this run name (NAME@run:RUN).",
)
@click.option(
    "--prefect",
    "use_prefect",
    is_flag=True,
    help="Run as a Prefect flow (in-process, no server needed).",
)
@click.option("--no-progress", is_flag=True, help="Hide progress bars.")
@click.option(
    "--nproc",
    type=int,
    default=None,
    help="Run as N processes through torch's launcher (torch.distributed.run): sharded stages "
    "split their shards by rank into one dataset, sft and opd train with DDP (FSDP with "
    "--set sft.fsdp=true / opd.fsdp=true). Under an external torchrun leave it out.",
)
@click.pass_obj
def run_cmd(
    store: Store,
    stage: str,
    profile: str | None,
    config_file: Path | None,
    sets: tuple[str, ...],
    input_refs: tuple[str, ...],
    force: bool,
    run_name: str,
    use_prefect: bool,
    no_progress: bool,
    nproc: int | None,
) -> None:
    """Run one STAGE on the latest (or given) inputs, or a chain (sft-chain, full).

    Work whose version already exists is skipped; the produced refs are printed.
    """
    from pipeline import distributed
    from pipeline.profiles import load_config

    ranks = distributed.env_ranks()
    if nproc is not None and nproc < 1:
        raise OpdError(f"--nproc must be >= 1 (processes to launch), got {nproc}")
    if nproc is not None and ranks is not None:
        raise OpdError(
            "--nproc launches processes, but this one already runs under torchrun (WORLD_SIZE "
            "is set): leave --nproc out; torchrun's --nproc-per-node sets the processes"
        )
    if use_prefect and ((nproc or 1) > 1 or ranks is not None):
        raise OpdError(
            "--prefect runs in one process: drop --nproc/torchrun, or fan out with the flow's "
            "`workers` parameter (see README, Scaling out)"
        )
    check_run_name(run_name)  # before any work: a bad name must not fail a finished run
    cfg = load_config(profile or "default", config_file, list(sets))
    if nproc is not None and nproc > 1:
        argv = ["--root", str(store.root), "run", stage, "--run-name", run_name]
        argv += ["--profile", profile] if profile else []
        argv += ["--config", str(config_file)] if config_file else []
        argv += [a for s in sets for a in ("--set", s)]
        argv += [a for r in input_refs for a in ("--input", r)]
        argv += ["--force"] * force + ["--no-progress"] * no_progress
        distributed.launch(nproc, argv)
        return
    args = (store, stage, cfg, profile, config_file, sets, input_refs, force, run_name)
    if ranks is None or ranks.world_size == 1:
        _setup_logging()
        _run(*args, use_prefect=use_prefect, progress=not no_progress)
        return
    _setup_logging(f"[rank {ranks.rank}/{ranks.world_size}] ")
    try:
        distributed.init(ranks)
        # Progress bars of several ranks would overwrite each other: rank 0 draws them.
        _run(*args, progress=not no_progress and ranks.rank == 0, ranks=ranks)
    except OpdError as e:
        raise distributed.failed("opd run", ranks.rank, ranks.world_size, e) from None
    finally:
        # A rank that exits with its gloo group still open can abort in the group's C++ teardown
        # ("terminate called without an active exception") instead of exiting with its error.
        distributed.finish()


def _run(
    store: Store,
    stage: str,
    cfg: PipelineConfig,
    profile: str | None,
    config_file: Path | None,
    sets: tuple[str, ...],
    input_refs: tuple[str, ...],
    force: bool,
    run_name: str,
    *,
    progress: bool,
    use_prefect: bool = False,
    ranks: Ranks | None = None,
) -> None:
    """`opd run` in this process: alone, or as one rank of a torchrun launch (`ranks`)."""
    from pipeline import distributed
    from pipeline.chains import CHAINS, record_results, run_chain, single_step
    from pipeline.runner import RunContext
    from pipeline.targets import TargetLoader, target_for

    ctx = RunContext(
        store=store, target_loader=TargetLoader(cfg.target), progress=progress, run_name=run_name
    )
    if stage in CHAINS:
        steps = CHAINS[stage](cfg)
        external = {}
        forced = {s.key for s in steps} if force else set()
    else:
        step = single_step(stage, cfg)
        roles = dict(r.split("=", 1) for r in input_refs if "=" in r)
        # Optional roles (e.g. opd's features) are read only when given with --input.
        known = [*step.stage.inputs, *step.stage.optional_inputs]
        bad = [r for r in input_refs if "=" not in r]
        bad += [r for r in roles if step.stage.input_kinds(r) is None]
        if bad:
            raise OpdError(f"--input {bad[0]!r}: expected ROLE=REF with ROLE in {known}")
        wanted = [*step.stage.inputs, *(r for r in roles if r not in step.stage.inputs)]
        external = {
            role: store.open(roles.get(role) or step.stage.default_ref(role)) for role in wanted
        }
        step.inputs = {role: role for role in wanted}
        stated = _states_target(profile, sets, config_file)
        cfg = cfg.model_copy(
            update={"target": target_for(external.values(), cfg.target, stated=stated)}
        )
        ctx.target_loader = TargetLoader(cfg.target)
        steps = [step]
        forced = {step.key} if force else set()
    if ranks is not None:
        what = (stage, cfg.model_dump(mode="json"), {r: str(d.ref) for r, d in external.items()})
        distributed.check_same_config(distributed.fingerprint(*what, sorted(forced), run_name))
        results = distributed.run_steps(steps, ctx, ranks, external=external, force=forced)
        if ranks.rank != 0:  # rank 0 records and reports the run
            return
    elif use_prefect:
        from flows.pipeline import run_steps_flow

        results = run_steps_flow(steps, ctx, external, forced)
    else:
        results = run_chain(steps, ctx, external=external, force=forced)
    record_results(ctx, run_name, results)
    for key, r in results.items():
        click.echo(f"{key:<12} {r.ref}" + ("  (cached)" if r.reused else f"  ({r.seconds:.1f}s)"))
    if stage == "full":
        from pipeline.export import export_chain_result

        info = export_chain_result(results, ctx.target_loader, store.root, cfg.drafting.k)
        if info is not None:
            click.echo(f"export       {info['path']} (+ speculators/ beside it)")
            click.echo(f"serve with:  {info['vllm_command']}")
            click.echo(f"trees:       {info['tree_note']}")


def _states_target(
    profile: str | None, sets: tuple[str, ...], config_file: Path | None = None
) -> bool:
    """Whether the command line names a target itself (else existing datasets decide it)."""
    named_in_file = config_file is not None and "target" in json.loads(config_file.read_text())
    return (
        profile is not None
        or named_in_file
        or any(s.split("=")[0].split(".")[0] == "target" for s in sets)
    )


def _config(profile: str | None, sets: tuple[str, ...], k: int | None = None):
    """The validated config (before any input is opened), with a command's `--k` as
    `drafting.k` where given."""
    from pipeline.profiles import load_config

    if k is not None and k < 1:
        raise OpdError(f"--k must be >= 1 (tokens drafted per step), got {k}")
    cfg = load_config(profile or "default", None, list(sets))
    if k is not None:
        # The ttt_steps >= k rule guards training configs, so raise it alongside; evaluate
        # checks K against the depth the drafter itself was trained to (its recorded ttt_steps).
        ttt = max(k, cfg.drafting.ttt_steps)
        more = [f"drafting.k={k}", f"drafting.ttt_steps={ttt}"]
        cfg = load_config(profile or "default", None, [*sets, *more])
    return cfg


def _loader(cfg, profile: str | None, sets: tuple[str, ...], datasets=()):
    """`cfg` with the target `datasets` were made with (if recorded and the command line names
    none), and its loader."""
    from pipeline.targets import TargetLoader, target_for

    target = target_for(datasets, cfg.target, stated=_states_target(profile, sets))
    return cfg.model_copy(update={"target": target}), TargetLoader(target)


@cli.command("eval")
@click.option(
    "--drafter",
    "drafter_ref",
    default="sft@latest",
    show_default=True,
    help="An sft or opd dataset.",
)
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
@click.option("--profile", default=None, help=_PROFILE_HELP)
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
    from pipeline import evaluate
    from pipeline.runner import RunContext, run_stage

    extra = (f"evaluate.temperature={temperature}",) if temperature is not None else ()
    extra += (f"evaluate.backend={backend}",) if backend is not None else ()
    inputs = {"prompts": store.open(prompts_ref), "drafter": store.open(drafter_ref)}
    if k is None and profile is None and not any(s.startswith("drafting.k=") for s in sets):
        from pipeline.tuning import trained_k

        k = trained_k(inputs["drafter"])  # like the target: the drafter's own, unless stated
    cfg = _config(profile, sets + extra, k)
    cfg, loader = _loader(cfg, profile, sets, inputs.values())
    ctx = RunContext(store=store, target_loader=loader, progress=not as_json)
    if not as_json:
        _setup_logging()
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


@cli.command("analyze")
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
@click.option("--profile", default=None, help=_PROFILE_HELP)
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
    from pipeline import analyze
    from pipeline.runner import RunContext, run_stage

    if run_name is not None:
        check_run_name(run_name)
    cfg = _config(profile, sets)
    inputs = analyze.resolve_sources(store, input_refs, run_name)
    _, loader = _loader(cfg, profile, sets, inputs.values())
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


@cli.command("export")
@click.option(
    "--drafter",
    "drafter_ref",
    default="sft@latest",
    show_default=True,
    help="An sft or opd dataset.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["eagle3", "speculators"]),
    default="eagle3",
    show_default=True,
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    required=True,
    help="Directory to write (new or empty; see --overwrite).",
)
@click.option(
    "--overwrite", is_flag=True, help="Replace a non-empty --out (never the target's directory)."
)
@click.option(
    "--k",
    type=int,
    default=None,
    help="num_speculative_tokens to serve with [default: the K `opd tune` measured fastest at "
    "--temperature, else the drafter's trained K].",
)
@click.option(
    "--temperature",
    type=float,
    default=0.0,
    show_default=True,
    help="The serving temperature whose `opd tune` result picks K.",
)
@click.option(
    "--verifier",
    default=None,
    metavar="NAME_OR_PATH",
    help="The target as the serving machine names it (speculators verifier.name_or_path) "
    "[default: the hub name in the target's config.json, else its local path].",
)
@click.option("--profile", default=None, help=_PROFILE_HELP)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE")
@click.pass_obj
def export_cmd(
    store: Store,
    drafter_ref: str,
    fmt: str,
    out: Path,
    overwrite: bool,
    k: int | None,
    temperature: float,
    verifier: str | None,
    profile: str | None,
    sets: tuple[str, ...],
) -> None:
    """Write a drafter as a directory vLLM loads, and print the command that serves it."""
    from pipeline.export import export_drafter
    from pipeline.tuning import serving_k, trained_k

    cfg = _config(profile, sets, k)
    drafter = store.open(drafter_ref)
    cfg, loader = _loader(cfg, profile, sets, [drafter])
    if k is None:
        k, source = serving_k(drafter, temperature, trained_k(drafter) or cfg.drafting.k)
    else:
        source = "--k"
    info = export_drafter(
        drafter,
        loader,
        fmt,  # type: ignore[arg-type]
        out,
        k,
        overwrite=overwrite,
        verifier=verifier,
    )
    for warning in info["warnings"]:
        click.echo(f"warning: {warning}", err=True)
    click.echo(
        f"exported {info['drafter']} as {fmt} to {info['path']} (round trip: identical logits)"
    )
    click.echo(f"num_speculative_tokens {k}: {source} (override with --k)")
    click.echo("serve it with:")
    click.echo(f"  {info['vllm_command']}")
    click.echo(f"  ({info['tree_note']})")


@cli.command("tune")
@click.option("--drafter", "drafter_ref", default="opd@latest", show_default=True)
@click.option("--prompts", "prompts_ref", default="prompts@latest", show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="Serving T.")
@click.option("--max-prompts", type=int, default=None, help="[profile: evaluate.max_prompts]")
@click.option("--repeats", type=int, default=2, show_default=True, help="Best of N per setting.")
@click.option(
    "--candidates", type=int, default=3, show_default=True, help="Best predicted settings timed."
)
@click.option("--profile", default=None, help=_PROFILE_HELP)
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
    from pipeline.tuning import heldout_prompts, run_tune

    for name, value in (
        ("--repeats", repeats),
        ("--candidates", candidates),
        ("--threads", threads),
    ):
        if value < 1:
            raise OpdError(f"{name} must be >= 1, got {value}")
    torch.set_num_threads(threads)
    cfg = _config(profile, sets)
    drafter, prompts_ds = store.open(drafter_ref), store.open(prompts_ref)
    cfg, loader = _loader(cfg, profile, sets, [drafter, prompts_ds])
    ecfg = cfg.evaluate
    prompts = heldout_prompts(prompts_ds, ecfg.split, max_prompts or ecfg.max_prompts)
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
    best, serve = result["best_measured"], result["serve"]
    click.echo(
        f"fastest at T={temperature}: K={best['k']} stop={best['threshold']} "
        f"({best['speedup_vs_plain']}x); serve with K={serve['k']} (vLLM drafts a fixed K)"
    )


@cli.command("serve")
@click.pass_obj
def serve_cmd(store: Store) -> None:
    """Register and serve the Prefect deployments (opd-pipeline/full) with a running server.

    Then: prefect deployment run opd-pipeline/full -p profile=tiny --watch
    """
    from flows.serve import serve

    serve(str(store.root.resolve()))


@cli.group("experiment")
def experiment_group() -> None:
    """Experiments that compare training methods end to end."""


_EXPERIMENT_OPTIONS = [
    click.option(
        "--profile", default="default", show_default=True, help="Config profile (tiny, default)."
    ),
    click.option(
        "--set",
        "sets",
        multiple=True,
        metavar="KEY=VALUE",
        help="Override one config value (repeatable).",
    ),
    click.option(
        "--budget",
        type=click.IntRange(min=1),
        default=None,
        help="Drafter row-steps per arm or variant [default: --budget-ratio x the warm-up's].",
    ),
    click.option(
        "--prompts",
        "prompts_ref",
        default=None,
        help="Use this prompts dataset instead of running the prompts stage.",
    ),
    click.option("--json", "as_json", is_flag=True, help="Print the whole result as JSON."),
]


def _experiment_options(f):
    for option in reversed(_EXPERIMENT_OPTIONS):
        f = option(f)
    return f


def _experiment_context(
    store: Store, profile: str, sets: tuple[str, ...], as_json: bool, name: str
) -> tuple[Any, Any]:
    """(config, RunContext) of an experiment command. It logs its progress to stderr also with
    --json (stdout then holds only the JSON): an experiment runs for minutes to hours."""
    from pipeline.runner import RunContext

    cfg, loader = _loader(_config(profile, sets), profile, sets)
    _setup_logging()
    ctx = RunContext(store=store, target_loader=loader, progress=not as_json, run_name=name)
    return cfg, ctx


def _command_line(store: Store, args: list[str]) -> str:
    """The command as the report quotes it (the options that were given, in canonical form)."""
    return shlex.join(["opd", "--root", str(store.root), "experiment", *args])


@experiment_group.command("opd-vs-sft")
@_experiment_options
@click.option(
    "--seeds",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Seeds per arm (mean and spread over them).",
)
@click.option(
    "--first-seed",
    type=click.IntRange(min=0),
    default=None,
    help="First seed of the arms [default: sft.seed]; the warm-up keeps sft.seed, so processes "
    "running disjoint seeds share it.",
)
@click.option(
    "--budget-ratio",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Budget per arm as a share of the SFT warm-up's row-steps.",
)
@click.option(
    "--sft-data-temperature",
    type=float,
    default=None,
    help="Sample the fresh target sequences continued SFT trains on at this temperature "
    "[default: the OPD rollouts' temperature].",
)
@click.pass_obj
def opd_vs_sft_cmd(
    store: Store,
    profile: str,
    sets: tuple[str, ...],
    seeds: int,
    first_seed: int | None,
    budget: int | None,
    budget_ratio: float,
    sft_data_temperature: float | None,
    prompts_ref: str | None,
    as_json: bool,
) -> None:
    """From one SFT warm-up, spend the same drafter budget on continued SFT and on Draft-OPD
    rounds; compare tau on held-out prompts at T=0 and T=1, and plot held-out tau against
    row-steps for both arms. Writes a report dataset (experiment@VERSION).

    The budget counts drafter forward+backward row-steps (TTT-unrolled rows x steps).
    """
    from pipeline import experiment

    cfg, ctx = _experiment_context(store, profile, sets, as_json, "experiment-opd-vs-sft")
    args = ["opd-vs-sft", "--profile", profile, *(f"--set={s}" for s in sets)]
    args += ["--seeds", str(seeds)]
    args += ["--first-seed", str(first_seed)] if first_seed is not None else []
    args += ["--budget", str(budget)] if budget else ["--budget-ratio", f"{budget_ratio:g}"]
    if sft_data_temperature is not None:
        args += ["--sft-data-temperature", f"{sft_data_temperature:g}"]
    args += ["--prompts", prompts_ref] if prompts_ref else []
    result = experiment.opd_vs_sft(
        cfg,
        ctx,
        seeds=seeds,
        first_seed=first_seed,
        budget=budget,
        budget_ratio=budget_ratio,
        sft_data_temperature=sft_data_temperature,
        prompts=store.open(prompts_ref) if prompts_ref else None,
        command=_command_line(store, args),
    )
    click.echo(json.dumps(result, indent=2) if as_json else experiment.summary_text(result))


@experiment_group.command("ablate")
@_experiment_options
@click.option(
    "--factors",
    default="loss",
    show_default=True,
    help="Comma-separated factors to vary, one at a time around the OPD defaults: loss (every "
    "opd.loss), replays (greedy vs sampled at T=1), rounds (1-4), samples (replays per anchor "
    "at T=1: 1, 2, 4), gamma (0.5, 0.8, 1.0).",
)
@click.option(
    "--seeds",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Seeds per variant (mean and spread over them).",
)
@click.option(
    "--budget-ratio",
    type=click.FloatRange(min=0, min_open=True),
    default=0.25,
    show_default=True,
    help="Budget per variant as a share of the SFT warm-up's row-steps (small, so the default "
    "grid, 4 loss families x 2 seeds, takes an estimated 40 min on the default profile).",
)
@click.pass_obj
def ablate_cmd(
    store: Store,
    profile: str,
    sets: tuple[str, ...],
    factors: str,
    seeds: int,
    budget: int | None,
    budget_ratio: float,
    prompts_ref: str | None,
    as_json: bool,
) -> None:
    """Draft-OPD variants, one factor at a time, from opd-vs-sft's SFT warm-up at one drafter
    budget; tau at T=0 and T=1 per variant over seeds. Writes a report dataset
    (experiment@VERSION: Parquet table, PNG plot, report.md).
    """
    from pipeline import experiment

    names = [f.strip() for f in factors.split(",") if f.strip()]
    cfg, ctx = _experiment_context(store, profile, sets, as_json, "experiment-ablate")
    args = ["ablate", "--profile", profile, *(f"--set={s}" for s in sets)]
    args += ["--factors", ",".join(names), "--seeds", str(seeds)]
    args += ["--budget", str(budget)] if budget else ["--budget-ratio", f"{budget_ratio:g}"]
    args += ["--prompts", prompts_ref] if prompts_ref else []
    result = experiment.ablate(
        cfg,
        ctx,
        factors=names,
        seeds=seeds,
        budget=budget,
        budget_ratio=budget_ratio,
        prompts=store.open(prompts_ref) if prompts_ref else None,
        command=_command_line(store, args),
    )
    click.echo(json.dumps(result, indent=2) if as_json else experiment.ablate_summary_text(result))


@experiment_group.command("objectives")
@click.option(
    "--profile", default="default", show_default=True, help="Config profile (tiny, default)."
)
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override one config value (repeatable).",
)
@click.option(
    "--seeds",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="SFT runs per objective (mean and spread over them).",
)
@click.option(
    "--prompts",
    "prompts_ref",
    default=None,
    help="Use this prompts dataset instead of running the prompts stage.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the whole result as JSON.")
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
    from pipeline import objectives_experiment

    cfg, ctx = _experiment_context(store, profile, sets, as_json, "experiment-objectives")
    result = objectives_experiment.objectives(
        cfg, ctx, seeds=seeds, prompts=store.open(prompts_ref) if prompts_ref else None
    )
    click.echo(
        json.dumps(result, indent=2) if as_json else objectives_experiment.summary_text(result)
    )


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
