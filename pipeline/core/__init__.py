"""Shared machinery below the stages: config, the stage record and runner, checks, target and
drafter loading, training, and the helpers two stages need. Imports no stage."""
