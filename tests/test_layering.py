"""Architecture rules that code review alone would let slip."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "models", "storage", "benchmarks")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _files(*packages: str) -> list[Path]:
    return [p for pkg in packages for p in (REPO / pkg).rglob("*.py")]


def test_only_flows_import_prefect():
    offenders = [str(p.relative_to(REPO)) for p in _files(*PACKAGES) if "prefect" in _imports(p)]
    assert not offenders, f"Prefect imported outside flows/: {offenders}"


def test_imports_point_one_way():
    # flows -> pipeline -> (models, storage); models and storage never import upward.
    for pkg, banned in (
        ("models", {"pipeline", "flows"}),
        ("storage", {"pipeline", "flows", "models"}),
    ):
        for p in _files(pkg):
            bad = _imports(p) & banned
            assert not bad, f"{p.relative_to(REPO)} imports {bad}"


def test_no_pickle_loads():
    for p in _files(*PACKAGES, "flows"):
        src = p.read_text()
        assert "pickle.load" not in src, p
        for line in src.splitlines():
            if "torch.load(" in line:
                assert "weights_only=True" in line, f"{p}: {line.strip()}"
