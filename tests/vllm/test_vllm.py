"""vLLM's engine (the CPU build from `make vllm`) against the project's own decoding."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import cli
from models import vllm_engine
from pipeline.core.export import ensure_export
from pipeline.core.runner import run_stage
from pipeline.stages import generate
from pipeline.stages.evaluate import divergence
from tests.vllm.conftest import SETS, UNAVAILABLE, Embedded, K

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE)),
]


def _hf_greedy(embedded: Embedded, prompts: list[list[int]], max_new_tokens: int, eos=None):
    target = embedded.target
    cfg = generate.Config(max_new_tokens=max_new_tokens, backend="hf")
    pad = embedded.ctx.target_loader.tokenizer.pad_token_id
    eos = target.eos_token_ids if eos is None else eos
    out: list[tuple[list[int], str]] = []
    for b in range(0, len(prompts), 16):
        resp, why = generate.generate_batch(target.model, pad, eos, prompts[b : b + 16], cfg)
        out += list(zip(resp, why, strict=True))
    return out


def test_vllm_and_hf_greedy_agree_on_heldout_prompts(embedded: Embedded):
    prompts = embedded.heldout()
    n = embedded.cfg.evaluate.max_new_tokens
    hf = _hf_greedy(embedded, prompts, n)
    ours = vllm_engine.generate(
        embedded.plain, prompts, max_new_tokens=n, stop_ids=embedded.target.eos_token_ids
    )
    differ = [i for i, (a, b) in enumerate(zip(ours, hf, strict=True)) if a != b]
    for i in differ:  # shown with -rA / on failure: where they split and how close the call was
        gap = divergence(embedded.target, prompts[i], ours[i][0], hf[i][0])
        print(
            f"prompt {i}: first difference at token {gap['position']}, top-2 logit gap "
            f"{gap['top2_logit_gap']:.4f}"
        )
    agree = 1 - len(differ) / len(prompts)
    print(f"vLLM == HF greedy on {len(prompts) - len(differ)}/{len(prompts)} held-out prompts")
    assert agree >= 0.9


def test_a_stop_id_ends_and_closes_the_response_like_hf(embedded: Embedded):
    prompts = embedded.heldout()[:8]
    first = _hf_greedy(embedded, prompts[:1], 8)[0][0]
    stop = (first[3],)  # a token the target does emit, so at least one response stops on it
    hf = _hf_greedy(embedded, prompts, 32, eos=stop)
    ours = vllm_engine.generate(embedded.plain, prompts, max_new_tokens=32, stop_ids=stop)
    assert ours[0] == hf[0] == (first[:4], "eos")
    assert sum(a == b for a, b in zip(ours, hf, strict=True)) >= 7


def test_generate_stage_on_vllm_runs_in_a_prefect_flow_and_writes_the_hf_schema(
    embedded: Embedded, generated
):
    assert generated.manifest["config"]["engine"] == "vllm"
    hf_cfg = embedded.cfg.generate.model_copy(update={"backend": "hf", "max_prompts": 8})
    hf = run_stage(generate.STAGE, hf_cfg, {"prompts": embedded.prompts}, embedded.ctx).dataset
    assert hf.manifest["config"]["engine"] == "hf"
    ours = generated.scan().head(8).collect()
    theirs = hf.scan().collect()
    assert ours.schema == theirs.schema
    same_cols = ["seq_id", "prompt_id", "prompt_len", "temperature", "top_p", "seed"]
    assert ours.select(same_cols).equals(theirs.select(same_cols))
    rows = zip(ours["input_ids"].to_list(), theirs["input_ids"].to_list(), strict=True)
    assert sum(a == b for a, b in rows) >= 7


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_both_export_formats_load_and_speculate_losslessly(
    embedded: Embedded, drafter, eagle3_export, fmt
):
    path = ensure_export(drafter, embedded.ctx.target_loader, embedded.store.root, K, fmt)
    stats = vllm_engine.measure_speculation(
        embedded.plain,
        str(path),
        K,
        embedded.heldout(),
        method="eagle3",
        max_new_tokens=embedded.cfg.evaluate.max_new_tokens,
        temperature=0.0,
        seed=0,
        stop_ids=embedded.target.eos_token_ids,
    )
    print(f"{fmt}: {json.dumps(stats)}")
    assert stats["vllm_drafts"] > 0 and stats["tau_vllm"] > 1.2
    assert stats["vllm_lossless"] == 1.0


def test_opd_eval_backend_vllm_prints_tau_beside_tau_vllm(
    embedded: Embedded, drafter, eagle3_export
):
    sets = [a for s in SETS for a in ("--set", s)]
    args = ["--root", str(embedded.store.root), "eval", "--drafter", str(drafter.ref)]
    args += ["--k", str(K), "--temperature", "0", "--backend", "vllm", "--json", *sets]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    stats = json.loads(res.stdout)
    print(
        json.dumps(
            {k: stats[k] for k in ("tau", "tau_vllm", "vllm_lossless", "vllm_matches_project")}
        )
    )
    assert stats["vllm_lossless"] == 1.0
    assert stats["vllm_matches_project"] >= 0.9
    assert abs(stats["tau_vllm"] / stats["tau"] - 1) <= 0.10
    assert "tau_vllm_note" not in stats


def test_a_drafter_vllm_refuses_is_one_line_with_its_reason_and_path(
    embedded: Embedded, eagle3_export, tmp_path
):
    bad = tmp_path / "refused"
    shutil.copytree(eagle3_export, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["NoSuchEagleDrafter"]
    (bad / "config.json").write_text(json.dumps(config))
    spec = vllm_engine.EngineSpec(
        embedded.plain.model, embedded.plain.dtype, str(bad), K, method="eagle3"
    )
    with pytest.raises(vllm_engine.VllmError) as err:
        vllm_engine.engine(spec)
    msg = str(err.value)
    assert "\n" not in msg and str(bad) in msg and "NoSuchEagleDrafter" in msg, msg


def test_an_engine_without_room_for_its_kv_cache_names_the_setting_and_its_log(
    embedded: Embedded, tmp_path, capfd
):
    # A context this long needs ~12 GB of fp32 KV cache for one request; the default space is 1 GiB.
    model = tmp_path / "long-context-target"
    shutil.copytree(embedded.plain.model, model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 1_000_000
    (model / "config.json").write_text(json.dumps(config))
    log = tmp_path / "work" / "vllm.log"
    capfd.readouterr()
    with pytest.raises(vllm_engine.VllmError) as err:
        vllm_engine.engine(vllm_engine.EngineSpec(str(model)), log)
    msg = str(err.value)
    assert "\n" not in msg and "VLLM_CPU_KVCACHE_SPACE" in msg, msg
    assert msg.endswith(f"(vLLM's log: {log})"), msg
    # vLLM's traceback is in the log, not on the terminal
    assert "Traceback" in log.read_text() and "Traceback" not in capfd.readouterr().err


_VLLM_LINE = re.compile(r"\b(INFO|WARNING)\b|Triton|LD_PRELOAD")


def test_the_generate_stage_on_vllm_prints_none_of_vllms_lines(embedded: Embedded, tmp_path):
    # in a process of its own, as `opd run` is: its engine starts there (this one's is cached)
    root = tmp_path / "data"
    shutil.copytree(embedded.prompts.path, root / "prompts" / embedded.prompts.ref.version)
    (root / "prompts" / "LATEST").write_text(embedded.prompts.ref.version + "\n")
    env = os.environ | {"OPD_HOME": str(root), "OMP_NUM_THREADS": "1"}
    env.pop(vllm_engine.VERBOSE_ENV, None)
    sets = ["generate.backend=vllm", "generate.max_prompts=4", "generate.max_new_tokens=8"]
    cmd = [sys.executable, "-m", "cli.main", "run", "generate", "--no-progress"]
    done = subprocess.run(
        [*cmd, *(a for s in sets for a in ("--set", s))],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    printed = (done.stdout + done.stderr).splitlines()
    assert [line for line in printed if _VLLM_LINE.search(line)] == []
    (said,) = [line for line in printed if "[generate] vLLM's engine log: " in line]
    log = Path(said.split("[generate] vLLM's engine log: ")[1])
    assert log.parent == root / "_work" / "generate" / log.parent.name
    assert sum(line.startswith("INFO ") for line in log.read_text().splitlines()) > 10


def _defunct_children() -> list[str]:
    """This process's zombie children, as "PID NAME" (read from /proc; a process that ends
    while it is read is skipped)."""
    found = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = stat_file.read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        if int(ppid) == os.getpid() and state == "Z":
            found.append(f"{stat_file.parent.name} {name}")
    return found


def test_closing_an_engine_leaves_no_defunct_engine_process(embedded: Embedded, eagle3_export):
    # the last test of this module to use the EAGLE-3 engine: the chain closes engines it started
    # and runs on, so a killed engine core must not stay behind as a zombie
    plain = embedded.plain
    spec = vllm_engine.EngineSpec(plain.model, plain.dtype, str(eagle3_export), K, method="eagle3")
    sockets = vllm_engine._ENGINE_SOCKETS[spec]
    assert list(sockets.iterdir())  # the engine's unix sockets, in a directory of its own
    vllm_engine.close(spec)
    assert _defunct_children() == []
    assert not sockets.exists()  # none left behind in the temporary directory
