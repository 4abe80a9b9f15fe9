"""Grading: the `check_*` functions that exercise cells call, and the grade command.

Exercises in `exercises/` are generated from `solutions/`; a learner fills in a function and
a check cell calls `parallel_lab.grading.check_<name>(learner_fn)`, which runs the learner's
algorithm on real ranks, compares it with a reference, and names what differed.
`python -m parallel_lab grade exercises/NN_topic.ipynb` grades a whole notebook from the
pristine solution's check cells, so a learner's edited outputs never count.

Read in this order:
  checks/   one module per lesson; `checks/__init__.py` states the contract every check keeps
  engine.py the grade command: assemble, execute in a fresh kernel, report
"""

from parallel_lab.grading.engine import *  # noqa: F403
from parallel_lab.grading.engine import __all__  # noqa: F401,E402 - every check, the engine's names
