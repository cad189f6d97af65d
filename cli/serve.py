"""`opd export` and `opd serve`: a drafter as a directory vLLM loads, and the Prefect deployments."""

from __future__ import annotations

from pathlib import Path

import click

from cli.common import DRAFTER_OPTION, PROFILE_HELP, command_config, command_target
from storage import OpdError, Store


@click.command("export")
@DRAFTER_OPTION
@click.option(
    "--format",
    "fmt",
    default=None,
    help="Export format, one of the drafter kind's: eagle3 (default) or speculators for an "
    "EAGLE-3 drafter.",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="Directory to write (new or empty; see --overwrite).",
)
@click.option(
    "--verify",
    "verify_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Check an export directory against the sha256 of every file it was written with "
    "(opd_export.json), and export nothing.",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace a non-empty --out (never the target's directory or the data root, nor "
    "anything inside them).",
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
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16"]),
    default=None,
    help="Cast the drafter's weights to this dtype [default: as trained]; bfloat16 halves "
    "the files, and the round-trip check compares the cast drafter.",
)
@click.option("--profile", default=None, help=PROFILE_HELP)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE")
@click.pass_obj
def export_cmd(
    store: Store,
    drafter_ref: str,
    fmt: str | None,
    out: Path | None,
    verify_dir: Path | None,
    overwrite: bool,
    k: int | None,
    temperature: float,
    verifier: str | None,
    dtype: str | None,
    profile: str | None,
    sets: tuple[str, ...],
) -> None:
    """Write a drafter as a directory vLLM loads, and print the command that serves it."""
    from pipeline.core.export import export_drafter, verify_export
    from pipeline.core.tuning import serving_k, trained_k

    if verify_dir is not None:
        if out is not None:
            raise OpdError("--verify checks an existing export and --out writes one: pass one")
        n = verify_export(verify_dir)
        click.echo(f"{verify_dir}: all {n} files match their sha256 (opd_export.json)")
        return
    if out is None:
        raise OpdError("--out is required: the directory to export into (or --verify DIR)")
    cfg = command_config(profile, sets, k)
    drafter = store.open(drafter_ref)
    cfg, loader = command_target(cfg, profile, sets, [drafter])
    if k is not None:
        source = "--k"
    elif any(s.partition("=")[0].strip() == "drafting.k" for s in sets):
        k, source = cfg.drafting.k, "--set drafting.k"  # stated like any other setting
    else:
        k, source = serving_k(drafter, temperature, trained_k(drafter) or cfg.drafting.k)
    info = export_drafter(
        drafter, loader, fmt, out, k, overwrite=overwrite, verifier=verifier, dtype=dtype
    )
    if info["num_speculative_tokens"] != k:
        source = f"the drafter's block (asked for {k}; vLLM drafts a whole block)"
    for warning in info["warnings"]:
        click.echo(f"warning: {warning}", err=True)
    click.echo(
        f"exported {info['drafter']} as {info['format']} to {info['path']} (round trip: identical logits)"
    )
    click.echo(
        f"num_speculative_tokens {info['num_speculative_tokens']}: {source} (override with --k)"
    )
    click.echo("serve it with:")
    click.echo(f"  {info['vllm_command']}")
    if info["tree_note"]:
        click.echo(f"  ({info['tree_note']})")


@click.command("serve")
@click.pass_obj
def serve_cmd(store: Store) -> None:
    """Register and serve the Prefect deployments (opd-pipeline/full) with a running server.

    Then: prefect deployment run opd-pipeline/full -p profile=tiny --watch
    """
    from flows.serve import serve

    serve(str(store.root.resolve()))
