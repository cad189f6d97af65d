"""Named recipes: every file loads strictly and runs (the tiny ones for real, the others
`--dry-run`); bad recipe files are one-line errors."""

import json

import pytest
from click.testing import CliRunner

from lab.cli import cli
from lab.recipes import load_recipe, recipe_names
from storage import OpdError, Store

TINY = ["tiny-eagle3-t0", "tiny-dflash-t1"]
LARGE = ["smollm2-eagle3", "smollm2-dflash", "llama-3.1-8b-eagle3"]


def test_the_recipes_are_the_named_ones_and_each_makes_a_valid_config():
    assert recipe_names() == sorted(TINY + LARGE)
    for name in recipe_names():
        recipe = load_recipe(name)
        assert recipe.name == name and f"--recipe {name}" in recipe.command
        assert recipe.config().model_dump() == recipe.config().model_dump()
        assert recipe.chain_command().startswith(f"opd run full --profile {recipe.profile}")
    assert load_recipe("tiny-dflash-t1").config().drafter.kind == "dflash"
    assert load_recipe("tiny-eagle3-t0").config().opd.temperature == 0.5


def _benchmark_files(tmp_path, monkeypatch):
    """EAGLE-format question files where the SmolLM2 recipes look for them (../shared/...)."""
    prompts = tmp_path / "shared" / "data" / "prompts"
    prompts.mkdir(parents=True)
    for name in ("mt_bench", "gsm8k"):
        rows = [
            {"question_id": i, "category": name, "turns": [f"{name} question {i}?"]}
            for i in range(3)
        ]
        (prompts / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "checkout").mkdir()
    monkeypatch.chdir(tmp_path / "checkout")


@pytest.mark.parametrize("name", TINY + LARGE)
def test_every_recipe_dry_runs_without_writing(tmp_path, monkeypatch, name):
    _benchmark_files(tmp_path, monkeypatch)
    root = tmp_path / "data"
    for command in (["opd-vs-sft", "--seeds", "2"], ["ablate", "--factors", "gamma"]):
        args = ["--root", str(root), "experiment", *command, "--recipe", name, "--dry-run"]
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 0, r.output
        recipe = load_recipe(name)
        assert f"recipe {name}: {recipe.description}" in r.output
        assert all(f"--set {s}" in r.output for s in recipe.set)
        assert f"experiment {command[0]} --recipe {name}" in r.output
    assert not root.exists()


def test_a_missing_benchmark_file_is_refused_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ../shared/data/prompts from here
    args = ["--root", str(tmp_path / "data"), "experiment", "opd-vs-sft"]
    r = CliRunner().invoke(cli, [*args, "--recipe", "smollm2-eagle3", "--dry-run"])
    assert r.exit_code == 2 and r.output.startswith("error: invalid config: prompts.heldout_sets")
    assert not (tmp_path / "data").exists()


@pytest.mark.slow
def test_the_tiny_recipes_run(tmp_path):
    """Both tiny recipes end to end, one seed at a small budget: each writes its report."""
    store = Store(tmp_path)
    for name in TINY:
        args = ["--root", str(tmp_path), "--threads", "1", "experiment", "opd-vs-sft"]
        args += ["--recipe", name, "--seeds", "1", "--budget-ratio", "0.5", "--json"]
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 0, r.output
        result = json.loads(r.stdout)
        assert result["drafter_kind"] == load_recipe(name).config().drafter.kind
        report = store.open(result["report"])
        assert f"--recipe {name} --seeds 1" in report.file("report.md").read_text()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('description = "d"\ncommand = "c"\nprofile = "tiny"\nseeds = 3\n', "seeds: Extra inputs"),
        ('description = "d"\ncommand = "c"\nprofile = "tiny"\nset = "rounds=1"\n', "set: Input"),
        ('description = "d"\ncommand = "c"\nprofile = "nope"\n', "unknown profile 'nope'"),
        ('name = "x"\ndescription = "d"\ncommand = "c"\nprofile = "tiny"\n', "drop its `name`"),
        ('description = "d"\ncommand = "c"\nprofile = "tiny"\nset = ["sft.lr=-1"]\n', "sft.lr"),
        ("description = \n", "cannot read recipe"),
    ],
)
def test_a_bad_recipe_file_is_one_line_error(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(OpdError, match=message):
        load_recipe(str(path))
    r = CliRunner().invoke(cli, ["--root", str(tmp_path / "d"), "experiment", "recipes", str(path)])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and r.output.startswith("error: ")
