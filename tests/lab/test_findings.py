"""`opd publish` copies a report out of a data root; lab.findings renders the findings' tables
from what is published, and docs/findings.md is what the published reports give."""

import json

import pyarrow as pa
import pytest
from click.testing import CliRunner

from lab import findings
from lab.cli import cli
from lab.publish import publish
from storage import OpdError, Store

HEADLINE = {
    "tau_sft_warmup": 2.5,
    "tau_sft_continued": 3.0,
    "tau_sft_continued_per_seed": [2.9, 3.1],
    "tau_opd": 3.3,
    "tau_opd_per_seed": [3.2, 3.4],
    "opd_over_sft_continued": 1.1,
    "opd_over_sft_continued_per_seed": [3.2 / 2.9, 3.4 / 3.1],
    "tau_sft_warmup_t1": 1.5,
    "tau_sft_continued_t1": 1.6,
    "tau_sft_continued_t1_per_seed": [1.6, 1.6],
    "tau_opd_t1": 1.52,
    "tau_opd_t1_per_seed": [1.5, 1.54],
    "opd_over_sft_continued_t1": 0.95,
    "opd_over_sft_continued_t1_per_seed": [1.5 / 1.6, 1.54 / 1.6],
}


def _report(store: Store):
    """A tiny opd-vs-sft report dataset and the result JSON its experiment saved beside it."""
    w = store.writer("experiment", stage="opd-vs-sft", stage_version="2", config={"seeds": [0, 1]})
    with w:
        w.write_parquet("tau.parquet", pa.table({"arm": ["opd"], "tau": [3.3]}))
        w.write_bytes("report.md", b"# opd-vs-sft\n", fmt="markdown")
        ds = w.commit(meta=HEADLINE)
    saved = store.root / "_experiments" / "opd-vs-sft-x.json"
    saved.parent.mkdir()
    saved.write_text(json.dumps({"report": str(ds.ref), "drafter_kind": "eagle3", **HEADLINE}))
    return ds


def test_publish_copies_the_report_with_its_provenance(tmp_path):
    store = Store(tmp_path / "data")
    ds = _report(store)
    into = tmp_path / "published"
    dest = publish(store, str(ds.ref), "tiny-one", into=into, hardware="this test")
    assert sorted(p.name for p in dest.iterdir()) == [
        "manifest.json",
        "provenance.json",
        "report.md",
        "result.json",
        "tau.parquet",
    ]
    prov = json.loads((dest / "provenance.json").read_text())
    assert prov["ref"] == str(ds.ref) and prov["stage"] == "opd-vs-sft"
    assert prov["hardware"] == "this test" and set(prov["files"]) == {
        "manifest.json",
        "report.md",
        "result.json",
        "tau.parquet",
    }
    assert json.loads((dest / "manifest.json").read_text())["meta"] == HEADLINE

    with pytest.raises(OpdError, match="exists; pass --replace"):
        publish(store, str(ds.ref), "tiny-one", into=into)
    (dest / "stale.txt").write_text("from before")
    publish(store, str(ds.ref), "tiny-one", into=into, replace=True)
    assert not (dest / "stale.txt").exists()
    assert sorted(p.name for p in into.iterdir()) == ["tiny-one"]  # no staging left behind


def test_publish_refuses_what_is_not_a_report(tmp_path):
    store = Store(tmp_path / "data")
    w = store.writer("features", stage="features", stage_version="1", config={})
    with w:
        w.write_parquet("a.parquet", pa.table({"x": [1]}))
        feats = w.commit()
    into = tmp_path / "published"
    with pytest.raises(OpdError, match="is a features dataset; publish a report"):
        publish(store, str(feats.ref), "x", into=into)
    with pytest.raises(OpdError, match="a published name is letters"):
        publish(store, str(feats.ref), "../x", into=into)
    assert not into.exists()
    r = CliRunner().invoke(cli, ["--root", str(store.root), "publish", str(feats.ref), "--as", "x"])
    assert r.exit_code == 2 and r.output.startswith("error: ") and r.output.count("\n") == 1


def test_a_table_is_regenerated_from_a_published_report(tmp_path):
    store = Store(tmp_path / "data")
    into = tmp_path / "lab" / "published"
    publish(store, str(_report(store).ref), "tiny-one", into=into, hardware="this test")
    docs = tmp_path / "docs" / "findings.md"
    docs.parent.mkdir()
    text = "# F\n\n<!-- findings: opd-vs-sft tiny-* -->\nstale\n<!-- /findings -->\nafter\n"
    out = findings.render(text, docs, into)
    link = "[tiny-one](../lab/published/tiny-one/report.md)"
    assert f"| {link} | EAGLE-3 | 2 | 0 | 2.500 | 3.000 ± 0.141 | 3.300 ± 0.141 |" in out
    assert "**1.100** (1.103, 1.097)" in out and "**0.950** (0.938, 0.963)" in out
    assert "stale" not in out and out.endswith("<!-- /findings -->\nafter\n")
    assert findings.render(out, docs, into) == out  # rendering again changes nothing
    worse = text.replace("tiny-* -->", "tiny-* worse -->")
    assert "**1.100**" not in findings.render(worse, docs, into)
    empty = findings.render(text.replace("tiny-*", "smollm2-*"), docs, into)
    assert "_No report published as `smollm2-*` yet" in empty


def test_the_findings_are_what_the_published_reports_give():
    for docs in findings.DOCS:
        text = docs.read_text()
        assert findings.render(text, docs) == text, f"{docs}: run python -m lab.findings"
    assert findings.main(["--check"]) == 0


def _published_rows(tmp_path, record: dict, name: str, table: str, **publish_args) -> list[str]:
    """Publish `record` (a benchmark's JSON) as `name`, render the `table` block over what is
    published, and return that report's rows."""
    saved = tmp_path / f"{name}.json"
    saved.write_text(json.dumps(record))
    into = tmp_path / "lab" / "published"
    publish(Store(tmp_path / "data"), str(saved), name, into=into, **publish_args)
    docs = tmp_path / "docs" / "findings.md"
    docs.parent.mkdir()
    out = findings.render(f"<!-- findings: {table} smollm2-* -->\n<!-- /findings -->\n", docs, into)
    return [line for line in out.splitlines() if line.startswith(f"| [{name}]")]


def test_the_sft_curve_is_rendered_from_a_published_record_in_token_order(tmp_path):
    point = dict(train_sequences=10, steps=3, epochs=3.0, acc=[0.5], tau_chain=2.0)
    record = {
        "points": [
            point | {"share": 1.0, "generated_tokens": 1_262_356, "tau_sim": 1.934},
            point | {"share": 0.1, "generated_tokens": 128_378, "tau_sim": 1.26},
        ]
    }
    rows = _published_rows(tmp_path, record, "smollm2-curve", "sft-curve", hardware="H200")
    assert [r.split(" | ")[3] for r in rows] == ["0.13M", "1.26M"]
    assert "**1.260**" in rows[0] and "**1.934**" in rows[1] and rows[1].endswith("| H200 |")


def test_an_sft_step_benchmark_renders_one_row_per_dtype_and_loss_path(tmp_path):
    def setting(bf16: bool, loss: str, tokens_per_s: float, of_roof: float) -> dict:
        measured = dict(bf16=bf16, loss=loss, tokens_per_s=tokens_per_s, of_roof=of_roof)
        return measured | dict(roof_gflop_per_s=414.4, speed_vs_unfused_fp32=tokens_per_s / 400)

    record = dict(kind="eagle3", batch_tokens=1024, ttt_steps=7, cpu_capability="AVX2", threads=2)
    record["settings"] = [setting(False, "unfused", 400.0, 0.55), setting(True, "fused", 500, 0.8)]
    rows = _published_rows(tmp_path, record, "smollm2-step", "sft-step", hardware="Xeon")
    assert len(rows) == 2
    assert "| EAGLE-3 | 1,024 x 7 | fp32 | unfused | 400.0 | 414 | **0.55** | 1.00× |" in rows[0]
    assert "| bf16 | fused | 500.0 | 414 | **0.80** | 1.25× |" in rows[1]
    assert rows[1].endswith("| AVX2, 2 threads; Xeon |")


def test_a_target_dtypes_benchmark_renders_one_row_per_workload(tmp_path):
    workloads = {
        "decode_1": {"fp32_s": 0.056, "bf16_s": 0.04, "bf16_speedup": 1.4},
        "features": {"fp32_s": 2.7, "bf16_s": 1.5, "bf16_speedup": 1.8},
    }
    record = dict(workloads=workloads, native_bf16=True, cpu_capability="AVX-512-BF16", threads=2)
    rows = _published_rows(tmp_path, record, "smollm2-dtypes", "target-dtypes", hardware="EPYC")
    assert len(rows) == 2
    assert "| decode_1 | 56.0 | 40.0 | **1.40×** | bf16 |" in rows[0]
    assert "| features | 2,700.0 | 1,500.0 | **1.80×** | bf16 |" in rows[1]
    assert rows[1].endswith("| AVX-512-BF16, 2 threads; EPYC |")


def test_an_opd_see_result_renders_one_row_per_drafting_decoder(tmp_path):
    decoders = [
        {"decoder": "plain", "label": "plain decoding", "tokens_per_s": 20.0, "speedup": 1.0},
        {"decoder": "drafter", "label": "EAGLE-3 K=1", "tokens_per_s": 23.0, "speedup": 1.15}
        | {"tau": 1.3, "identical": 24, "prompts": 24, "tau_by_set": {"gsm8k": 1.31}},
    ]
    record = {"stage": "see", "cpu": "Xeon", "dtype": "float32", "threads": 2}
    [row] = _published_rows(tmp_path, record | {"decoders": decoders}, "smollm2-see", "see")
    assert "| EAGLE-3 K=1 | **1.300** (gsm8k 1.310) | **1.15×** | 24/24 |" in row
    assert row.endswith("| Xeon, float32, 2 threads |")


def test_a_vllm_benchmark_renders_one_row_per_speculator_beside_vllm_plain(tmp_path):
    def one(tau: float, speedup: float) -> dict:
        return {"tokens_per_s": 10 * speedup, "speedup_vs_plain": speedup, "tau": tau}

    plain = {"tokens_per_s": 10.0, "speedup_vs_plain": 1.0}
    engines = {"plain": plain, "ngram": one(2.0, 1.5), "eagle3 K=1": one(1.3, 1.2)}
    engines["eagle3 K=1"]["identical_to_plain"] = 0.5
    engines["ngram"]["identical_to_plain"] = 1.0
    result = {"dtype": "float32", "k": {"ngram": 4, "exports": [1]}, "prompts": {"gsm8k": 4}}
    result |= {"by_set": {"gsm8k": engines}, "all": engines, "serve": {"plain": "vllm serve T"}}
    rows = _published_rows(tmp_path, result, "smollm2-vllm", "vllm", hardware="Xeon")
    assert len(rows) == 2  # plain is what each row is measured against, not a row
    assert "| ngram K=4 | **2.000** (gsm8k 2.000) | **1.50×** | 4/4 | 15.0 (10.0) |" in rows[0]
    assert "| eagle3 K=1 | **1.300** (gsm8k 1.300) | **1.20×** | 2/4 | 12.0 (10.0) |" in rows[1]
    assert rows[1].endswith("| float32, Xeon |")
