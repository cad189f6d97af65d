"""`opd`: the command line.

Every command takes the data root from `--root` or `OPD_HOME` (default ./opd-data). User
errors print one line, `error: ...`, and exit 2; nothing is written.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import click
import torch

from cli import data, measure, run, see, serve, target
from models import vllm_engine
from storage import OpdError, Store, default_root
from storage.layout import check_root_placement


class _Group(click.Group):
    """Turns user errors into one-line messages instead of tracebacks or click's usage block."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:  # parses the group's own options (--threads)
            return super().make_context(*args, **kwargs)
        except click.BadParameter as e:
            _fail(e.format_message())

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (OpdError, NotImplementedError) as e:  # the latter: a kind lacks a stage's method
            _fail(str(e))
        except click.BadParameter as e:  # a command's option out of its range or choices
            _fail(e.format_message())


def _fail(message: str) -> NoReturn:
    # A bad option value's message already names the option and the values it takes: click's
    # usage block around it would only bury it.
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--root",
    type=click.Path(path_type=Path),
    default=None,
    help="Data root holding all datasets [env OPD_HOME; default ./opd-data].",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="CPU threads for torch in this process and the processes it launches [default: "
    "torch's, one per core]. Give processes that share the cores their share of them.",
)
@click.option(
    "--verbose",
    is_flag=True,
    help="Show the engines' own output (vLLM's log, its Triton and LD_PRELOAD notices) on "
    "stderr instead of in a log file in the stage's work directory, the INFO notices of "
    "Prefect and other libraries, and transformers' progress bars [env OPD_VERBOSE=1].",
)
@click.pass_context
def cli(ctx: click.Context, root: Path | None, threads: int | None, verbose: bool) -> None:
    """Draft-OPD: train speculative-decoding drafters as versioned, resumable stages.

    Datasets are referenced as NAME@VERSION, NAME@latest (or just NAME) and NAME@run:RUN.
    """
    if threads is not None:
        torch.set_num_threads(threads)
        # for the ranks --nproc launches: they inherit the environment, not this setting
        os.environ["OMP_NUM_THREADS"] = str(threads)
    if root is not None:
        # named targets (target.path=smollm2) live under the root, and launched ranks resolve it
        os.environ["OPD_HOME"] = str(root)
    if verbose:
        os.environ[vllm_engine.VERBOSE_ENV] = "1"  # engines start in this process or its ranks
    check_root_placement(root if root is not None else default_root())
    ctx.obj = Store(root if root is not None else default_root())


for command in (
    data.ls_cmd,
    data.show_cmd,
    data.gc_cmd,
    data.data_group,
    run.run_cmd,
    measure.eval_cmd,
    measure.analyze_cmd,
    measure.tune_cmd,
    serve.export_cmd,
    serve.serve_cmd,
    see.see_cmd,
    target.target_group,
):
    cli.add_command(command)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
