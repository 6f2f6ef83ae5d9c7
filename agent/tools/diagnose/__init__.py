"""``mrc-agent diagnose``: one window, three views of a target, and a verdict.

Over the same window this package runs

* ``py-spy record`` of the target twice at once, both ``--nonblocking`` (the target is never
  paused, so two readers do not fight over ptrace): an interactive flame graph
  (``flamegraph.svg``) for people and raw collapsed stacks per thread (``stacks.txt``,
  ``--threads --function``: one line per distinct stack, frames keyed by function and the
  function's first line) from which the top functions are computed;
* the agent's own collectors (process, gpu, gpm, profiling where available, derived) in-process
  at ``interval`` for the target alone, saved as ``samples.jsonl`` (every sample of every
  pass) and ``golden_triangle.csv`` (one row per pass and GPU);
* the GPU idle windows, from the derived collector's :class:`IdleTracker` fed with the finest
  utilisation points the GPU source gives.

It then decides a verdict (see :func:`decide`) and writes ``report.json`` and ``report.txt``. The
same :func:`diagnose` runs behind the CLI and behind the on-alert captures of
:mod:`mrc_agent.agent.tools.capture`; a capture of a target whose stacks the agent samples runs
no py-spy but reads those samples (:class:`~mrc_agent.agent.tools.diagnose.command.StackHistory`),
the minute before the alert included.

The rooms, each importing only those before it:

* :mod:`~mrc_agent.agent.tools.diagnose.pyspy`: finding and running py-spy, and its failures;
* :mod:`~mrc_agent.agent.tools.diagnose.stacks`: parsing collapsed stacks (py-spy's, or made
from the agent's own samples), top functions, image share;
* :mod:`~mrc_agent.agent.tools.diagnose.flamegraph`: the flame graph of the agent's own samples;
* :mod:`~mrc_agent.agent.tools.diagnose.sampling`: the in-process loop's extra collectors (idle
windows,
  watched and borrowed collectors) and the hottest thread's runnable share;
* :mod:`~mrc_agent.agent.tools.diagnose.verdict`: the CPU and GPU analysis, the rules and the
verdict;
* :mod:`~mrc_agent.agent.tools.diagnose.writers`: the files of a diagnosis and the text report;
* :mod:`~mrc_agent.agent.tools.diagnose.command`: :func:`diagnose` and the command.

The package exports its entry points (:func:`diagnose`, :func:`run_diagnose_command`); the
rest is imported from its room.
"""

from __future__ import annotations

from mrc_agent.agent.tools.diagnose.command import diagnose, run_diagnose_command

__all__ = ["diagnose", "run_diagnose_command"]
