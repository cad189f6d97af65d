"""The embedded default target: a small Llama LM of Python trained on the stdlib sources.

`python -m models.tiny_target.train` builds it (corpus -> BPE tokenizer -> model) into
`models/tiny_target/model/`; `python -m models.tiny_target.report` writes its quality report.
"""
