"""pipeline package."""

import logging

from pipeline.core.logs import shorten_floats

# Every stage logs to "opd"; installed here so each process that imports a stage has it.
shorten_floats(logging.getLogger("opd"))
