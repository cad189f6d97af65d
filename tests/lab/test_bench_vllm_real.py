import json

import pytest

from lab.benchmarks.bench_vllm_real import export_method
from models.drafters import KINDS


@pytest.mark.parametrize("kind", sorted(k for k, s in KINDS.items() if s.serve_method))
def test_an_export_is_served_with_its_own_kinds_method(tmp_path, kind):
    (tmp_path / "opd_drafter.json").write_text(json.dumps({"drafter_kind": kind}))
    assert export_method(str(tmp_path)) == (KINDS[kind].serve_method, str(tmp_path))


def test_a_method_given_wins_and_a_directory_without_a_record_is_refused(tmp_path):
    assert export_method(f"medusa={tmp_path}") == ("medusa", str(tmp_path))
    with pytest.raises(SystemExit, match="no opd_drafter.json there; give METHOD=DIR"):
        export_method(str(tmp_path))
