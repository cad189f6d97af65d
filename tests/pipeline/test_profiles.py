"""Profiles: a profile's per-kind section applies only to that kind's runs, under the user's."""

import json

import pytest
from click.testing import CliRunner

from cli.main import cli
from pipeline import profiles
from pipeline.profiles import load_config
from storage import OpdError


@pytest.fixture
def profile_dir(tmp_path, monkeypatch):
    (tmp_path / "p.json").write_text(
        json.dumps(
            {
                "sft": {"lr": 0.001},
                "kinds": {"dflash": {"sft": {"lr": 0.005, "epochs": 7}}},
            }
        )
    )
    monkeypatch.setattr(profiles, "PROFILE_DIR", tmp_path)
    return tmp_path


def test_a_kinds_section_applies_to_its_kind_only(profile_dir):
    eagle = load_config("p")
    assert (eagle.sft.lr, eagle.sft.epochs) == (0.001, 2.0)
    dflash = load_config("p", sets=["drafter.kind=dflash"])
    assert (dflash.sft.lr, dflash.sft.epochs) == (0.005, 7)


def test_the_users_settings_win_over_the_kinds_section(profile_dir, tmp_path):
    cfg = load_config("p", sets=["drafter.kind=dflash", "sft.lr=0.002"])
    assert (cfg.sft.lr, cfg.sft.epochs) == (0.002, 7)
    over = tmp_path / "over.json"
    over.write_text(json.dumps({"drafter": {"kind": "dflash"}, "sft": {"epochs": 3}}))
    cfg = load_config("p", config_file=over)
    assert (cfg.sft.lr, cfg.sft.epochs) == (0.005, 3)


def test_kinds_is_a_profile_section_not_a_config_key(profile_dir, tmp_path):
    over = tmp_path / "over.json"
    over.write_text(json.dumps({"kinds": {"dflash": {"sft": {"lr": 0.1}}}}))
    with pytest.raises(OpdError, match="kinds"):
        load_config("p", config_file=over)


def test_the_shipped_profiles_train_eagle3_as_before():
    # the kinds section must leave EAGLE-3 configs (and so their dataset versions) as they were
    for name in profiles.profiles():
        raw = json.loads((profiles.PROFILE_DIR / f"{name}.json").read_text())
        raw.pop("kinds", None)
        assert load_config(name) == profiles.PipelineConfig.model_validate(raw)


def test_a_kinds_layer_count_alone_derives_its_aux_ids_and_given_ids_of_that_count_fit():
    # the tiny profile's three ids were chosen for a three-layer reader
    two = load_config("tiny", None, ["drafter.kind=dflash", "drafter.target_layers=2"])
    assert two.target.aux_count == 2 and two.target.aux_layer_ids is None
    given = ["drafter.kind=dflash", "drafter.target_layers=2", "target.aux_layer_ids=[1,3]"]
    assert load_config("tiny", None, given).target.aux_layer_ids == [1, 3]
    # ids the user gives are never replaced: the wrong count is named
    with pytest.raises(OpdError, match=r"aux_layer_ids \[1, 3\] must be 3 ids"):
        load_config("tiny", None, ["target.aux_layer_ids=[1,3]"])
    assert load_config("tiny").target.aux_layer_ids == [1, 2, 3]  # the profile's own kind


def test_sft_of_a_kind_reading_other_layers_than_its_features_is_refused_before_work(tmp_path):
    args = ["--root", str(tmp_path), "--threads", "1", "run"]
    dflash = ["--profile", "tiny", "--no-progress", "--set", "drafter.kind=dflash"]
    dflash += ["--set", "drafter.target_layers=2"]
    for stage in ("prompts", "generate", "features"):
        made = CliRunner().invoke(cli, [*args, stage, *dflash])
        assert made.exit_code == 0, made.output
    sft = CliRunner().invoke(cli, [*args, "sft", "--no-progress", "--set", "drafter.kind=eagle3"])
    assert sft.exit_code == 2, sft.output
    assert "holds 2 target layers per position" in sft.output and "reads 3" in sft.output
    assert not (tmp_path / "sft").exists() and not (tmp_path / "_work" / "sft").exists()
