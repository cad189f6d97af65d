"""The lab: experiments, benchmarks, recipes and published findings. It imports the product
(cli, flows, pipeline, models, storage); nothing in the product imports it (tests/test_layering.py)."""
