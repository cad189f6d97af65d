"""What every drafter kind's export shares: its file names, the provenance key in its
config.json and the error it raises.

Below both models/export.py (the entry points, which reach the kinds through models/drafters.py)
and the kinds' own export modules, so neither imports the other.
"""

PROVENANCE_KEY = "opd_pipeline"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


class ExportError(ValueError):
    """An export (or an exported directory) violates an invariant vLLM silently depends on."""
