"""The prompts stage's sources, one module each; the stage (pipeline/stages/prompts.py) keeps
its config, its choice among them (`build_rows`) and `run`."""
