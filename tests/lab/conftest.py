"""The stage tests' fixtures: a store with a tiny prompts dataset and a random target."""

from tests.pipeline.conftest import tiny  # noqa: F401  (a fixture: pytest finds it by name)
