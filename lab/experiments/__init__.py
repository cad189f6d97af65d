"""Experiments that run the stages: opd-vs-sft, ablate (Draft-OPD) and objectives (SFT)."""
