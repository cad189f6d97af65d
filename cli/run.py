"""`opd run STAGE|CHAIN`: one stage or a chain of them, in one process, under torchrun, on
Dask or as a Prefect flow."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click

from cli.common import setup_logging, states_target
from storage import OpdError, Store, check_run_name

if TYPE_CHECKING:
    from pipeline.distributed import Ranks
    from pipeline.profiles import PipelineConfig


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


@dataclass(frozen=True)
class _Asked:
    """What `opd run`'s command line asks for, as `_run` reads it in each process."""

    stage: str
    profile: str | None
    config_file: Path | None
    sets: tuple[str, ...]
    input_refs: tuple[str, ...]
    force: bool
    run_name: str

    def argv(self, root: Path, no_progress: bool) -> list[str]:
        """The same request as `opd` arguments, for each process `--nproc` launches."""
        argv = ["--root", str(root), "run", self.stage, "--run-name", self.run_name]
        argv += ["--profile", self.profile] if self.profile else []
        argv += ["--config", str(self.config_file)] if self.config_file else []
        argv += [a for s in self.sets for a in ("--set", s)]
        argv += [a for r in self.input_refs for a in ("--input", r)]
        return argv + ["--force"] * self.force + ["--no-progress"] * no_progress


@click.command("run", cls=_RunCommand)
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
            "`workers` parameter (see docs/reference.md, Scaling out)"
        )
    check_run_name(run_name)  # before any work: a bad name must not fail a finished run
    cfg = load_config(profile or "default", config_file, list(sets))
    asked = _Asked(stage, profile, config_file, sets, input_refs, force, run_name)
    if nproc is not None and nproc > 1:
        distributed.launch(nproc, asked.argv(store.root, no_progress))
        return
    if ranks is None or ranks.world_size == 1:
        setup_logging()
        _run(store, asked, cfg, use_prefect=use_prefect, progress=not no_progress)
        return
    setup_logging(f"[rank {ranks.rank}/{ranks.world_size}] ")
    try:
        distributed.init(ranks)
        # Progress bars of several ranks would overwrite each other: rank 0 draws them.
        _run(store, asked, cfg, progress=not no_progress and ranks.rank == 0, ranks=ranks)
    except OpdError as e:
        raise distributed.failed("opd run", ranks.rank, ranks.world_size, e) from None
    finally:
        # A rank that exits with its gloo group still open can abort in the group's C++ teardown
        # ("terminate called without an active exception") instead of exiting with its error.
        distributed.finish()


def _run(
    store: Store,
    asked: _Asked,
    cfg: PipelineConfig,
    *,
    progress: bool,
    use_prefect: bool = False,
    ranks: Ranks | None = None,
) -> None:
    """`opd run` in this process: alone, or as one rank of a torchrun launch (`ranks`)."""
    from pipeline import distributed
    from pipeline.chains import CHAINS, record_results, run_chain, single_step
    from pipeline.core.drafters import check_drafter_settings, check_reads_recorded_target
    from pipeline.core.runner import RunContext
    from pipeline.core.targets import TargetLoader, check_engine_target, target_for

    stage = asked.stage
    ctx = RunContext(
        store=store,
        target_loader=TargetLoader(cfg.target),
        progress=progress,
        run_name=asked.run_name,
    )
    if stage in CHAINS:
        steps = CHAINS[stage](cfg)
        if any(s.stage.name == "sft" for s in steps):
            # sft's own check runs only once the stages before it have: a drafter the warm-up
            # cannot build must not cost them.
            check_drafter_settings(cfg.drafter, ctx.target_loader.target)
        external = {}
        forced = {s.key for s in steps} if asked.force else set()
    else:
        step = single_step(stage, cfg)
        roles = dict(r.split("=", 1) for r in asked.input_refs if "=" in r)
        # Optional roles (e.g. opd's features) are read only when given with --input.
        known = [*step.stage.inputs, *step.stage.optional_inputs]
        bad = [r for r in asked.input_refs if "=" not in r]
        bad += [r for r in roles if step.stage.input_kinds(r) is None]
        if bad:
            raise OpdError(f"--input {bad[0]!r}: expected ROLE=REF with ROLE in {known}")
        required = step.stage.required_roles(step.cfg)
        wanted = [*required, *(r for r in roles if r not in required)]
        external = {
            role: store.open(roles.get(role) or step.stage.default_ref(role)) for role in wanted
        }
        step.inputs = {role: role for role in wanted}
        stated = states_target(asked.profile, asked.sets, asked.config_file)
        cfg = cfg.model_copy(
            update={"target": target_for(external.values(), cfg.target, stated=stated)}
        )
        check_engine_target(step.stage.name, step.cfg, cfg.target)
        if step.stage.name == "sft" and "features" in external:  # a fresh drafter of cfg's kind
            check_reads_recorded_target(
                cfg.drafter, cfg.target.aux_count, str(external["features"].ref)
            )
        ctx.target_loader = TargetLoader(cfg.target)
        steps = [step]
        forced = {step.key} if asked.force else set()
    if ranks is not None:
        what = (
            stage,
            cfg.model_dump(mode="json"),
            {r: str(d.ref) for r, d in external.items()},
        )
        distributed.check_same_config(
            distributed.fingerprint(*what, sorted(forced), asked.run_name)
        )
        results = distributed.run_steps(steps, ctx, ranks, external=external, force=forced)
        if ranks.rank != 0:  # rank 0 records and reports the run
            return
    elif use_prefect:
        from flows.pipeline import run_steps_flow

        results = run_steps_flow(steps, ctx, external, forced)
    else:
        results = run_chain(steps, ctx, external=external, force=forced)
    record_results(ctx, asked.run_name, results)
    for key, r in results.items():
        click.echo(f"{key:<12} {r.ref}" + ("  (cached)" if r.reused else f"  ({r.seconds:.1f}s)"))
    export_k = cfg.drafting.k
    if stage in CHAINS:
        export_k = _report_final_evaluation(results, ctx, cfg) or export_k
    if stage == "full":
        from pipeline.chains import export_chain_result

        info = export_chain_result(results, ctx.target_loader, store.root, export_k)
        if info is not None:
            others = ", ".join(f"{f}/" for f in info["formats"][1:])
            click.echo(
                f"export       {info['path']}" + (f" (+ {others} beside it)" if others else "")
            )
            click.echo(f"serve with:  {info['vllm_command']}")
            if info["tree_note"]:
                click.echo(f"trees:       {info['tree_note']}")


def _report_final_evaluation(results: dict, ctx, cfg: PipelineConfig) -> int | None:
    """Print a chain's final evaluation beside the n-gram lookup, at the trained K and at the K
    `opd tune` measures fastest here; that K when it differs (the export serves it), else None."""
    from pipeline.chains import final_report, tuned_evaluation
    from pipeline.core.quicklook import cpu_name
    from pipeline.core.targets import resolve_dtype
    from pipeline.core.tuning import k_report

    final = results.get("evaluate")
    if final is None or final.dataset is None:
        return None
    meta = final.dataset.meta
    if "k" not in meta or "drafter" not in meta:
        return None
    tuned = tuned_evaluation(results, ctx, cfg)
    if tuned is not None:
        click.echo(f"{'evaluate':<12} {tuned.ref}  (at opd tune's K)")
    drafter = ctx.store.open(meta["drafter"])
    click.echo(f"draft length {k_report(drafter, meta['k'], meta.get('temperature', 0.0))}")
    machine = f"CPU {cpu_name()}, target dtype {resolve_dtype(ctx.target_loader.cfg)}"
    for line in final_report(final.dataset, tuned and tuned.dataset, machine):
        click.echo(line)
    # Served at the K measured fastest here, as `opd export` does.
    return None if tuned is None else tuned.dataset.meta["k"]
