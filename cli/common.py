"""What several commands share: the profile and drafter options, logging, and the config /
target a command line names."""

from __future__ import annotations

import json
from pathlib import Path

import click

from storage import OpdError

PROFILE_HELP = (
    "Config profile [default: the target the input datasets were made with, else 'default']."
)


DRAFTER_OPTION = click.option(
    "--drafter",
    "drafter_ref",
    default="sft@latest",
    show_default=True,
    help="An sft or opd dataset.",
)
"""The drafter a command reads (`opd eval`, `opd export`): the warm-up's unless named."""


def _stage_lines_and_problems(record) -> bool:
    """The project's own lines, and warnings or errors from anywhere: not the INFO notices of
    the libraries under it (Prefect's server and flow-run states, httpx's requests)."""
    import logging

    return record.levelno >= logging.WARNING or record.name.split(".")[0] == "opd"


def setup_logging(prefix: str = "") -> None:
    import logging

    from models.vllm_engine import verbose

    root = logging.getLogger()
    before = list(root.handlers)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {prefix}%(message)s", datefmt="%H:%M:%S"
    )
    if not verbose():  # only on the handler set up here, not on one a host process installed
        for handler in set(root.handlers) - set(before):
            handler.addFilter(_stage_lines_and_problems)


def states_target(
    profile: str | None, sets: tuple[str, ...], config_file: Path | None = None
) -> bool:
    """Whether the command line names a target itself (else existing datasets decide it)."""
    named_in_file = config_file is not None and "target" in json.loads(config_file.read_text())
    return (
        profile is not None
        or named_in_file
        or any(s.split("=")[0].split(".")[0] == "target" for s in sets)
    )


def command_config(profile: str | None, sets: tuple[str, ...], k: int | None = None):
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


def command_target(cfg, profile: str | None, sets: tuple[str, ...], datasets=()):
    """`cfg` with the target `datasets` were made with (if recorded and the command line names
    none), and its loader."""
    from pipeline.core.targets import TargetLoader, target_for

    target = target_for(datasets, cfg.target, stated=states_target(profile, sets))
    return cfg.model_copy(update={"target": target}), TargetLoader(target)


def check_prompts_dataset(prompts_ds, option: str) -> None:
    """`option` names the prompts evaluate decodes, not another stage's dataset."""
    from pipeline.stages import evaluate

    kinds = evaluate.STAGE.input_kinds("prompts")
    if prompts_ds.ref.name not in kinds:
        raise OpdError(
            f"{option} {prompts_ds.ref} is a {prompts_ds.ref.name} dataset, not a "
            f"{' or '.join(kinds)} dataset: pass {option} prompts@VERSION (or prompts@latest)"
        )


def recorded_target(recorded: dict | None, profile: str | None, sets: tuple[str, ...], what: str):
    """The target of a command reading a file or directory that records its own (`what`): that
    one, with the command line's `--set target.*` over it; `--profile` names its own target."""
    from pydantic import ValidationError

    from pipeline.core.targets import TargetConfig
    from pipeline.profiles import load_config, parse_set

    if profile is not None or not recorded:
        if profile is None and not states_target(None, sets):
            raise OpdError(
                f"{what} names no target: pass --profile NAME or --set target.path=... (the "
                "target it was made for)"
            )
        return load_config(profile or "default", None, list(sets)).target
    spec = dict(recorded)
    for item in sets:
        over = parse_set(item)
        if "target" in over:
            spec = _merged(spec, over["target"])
    try:
        return TargetConfig.model_validate(spec)
    except ValidationError as e:
        raise OpdError(f"invalid target for {what}: {e.errors()[0]['msg']}") from None


def _merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if nested else value
    return out
