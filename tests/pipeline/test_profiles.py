"""Profiles: a profile's per-kind section applies only to that kind's runs, under the user's."""

import json

import pytest

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
