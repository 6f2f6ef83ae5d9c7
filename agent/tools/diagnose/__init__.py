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

It then decides a verdict (see :func:`decide`) and writes ``report.json`` and ``report.txt``.
The same :func:`diagnose` runs behind the CLI and behind the on-alert captures of
:mod:`agent.tools.capture`.

The rooms, each importing only those before it:

* :mod:`~agent.tools.diagnose.pyspy`: finding and running py-spy, and its failures;
* :mod:`~agent.tools.diagnose.stacks`: parsing collapsed stacks, top functions, image share;
* :mod:`~agent.tools.diagnose.sampling`: the in-process loop's extra collectors (idle windows,
  watched and borrowed collectors) and the hottest thread's runnable share;
* :mod:`~agent.tools.diagnose.verdict`: the CPU and GPU analysis, the rules and the verdict;
* :mod:`~agent.tools.diagnose.writers`: the files of a diagnosis and the text report;
* :mod:`~agent.tools.diagnose.command`: :func:`diagnose` and the command.

Every public name of these rooms is re-exported here, so ``from agent.tools.diagnose import X``
works as it did when the diagnosis was one module.
"""

from __future__ import annotations

from agent.tools.diagnose.command import (
    EXIT_OK,
    EXIT_PY_SPY,
    MAX_DURATION,
    MIN_DURATION,
    Diagnosis,
    check_pid,
    diagnose,
    run_diagnose_command,
)
from agent.tools.diagnose.pyspy import (
    PY_SPY_RATE,
    PySpy,
    PySpyError,
    explain_failure,
    find_py_spy,
)
from agent.tools.diagnose.sampling import (
    Borrowed,
    IdleWindows,
    runnable,
)
from agent.tools.diagnose.stacks import (
    IMAGE_FILE,
    IMAGE_FUNCTION,
    Frame,
    Stack,
    image_share,
    is_image_frame,
    parse_collapsed,
    parse_frame,
    thread_samples,
    top_functions,
)
from agent.tools.diagnose.verdict import (
    VERDICTS,
    Rules,
    Verdict,
    analyse_cpu,
    analyse_gpu,
    decide,
)
from agent.tools.diagnose.writers import (
    CSV_COLUMNS,
    FILES,
    render_text,
    write_golden_triangle,
    write_samples,
)

__all__ = [
    "Borrowed",
    "CSV_COLUMNS",
    "Diagnosis",
    "EXIT_OK",
    "EXIT_PY_SPY",
    "FILES",
    "Frame",
    "IMAGE_FILE",
    "IMAGE_FUNCTION",
    "IdleWindows",
    "MAX_DURATION",
    "MIN_DURATION",
    "PY_SPY_RATE",
    "PySpy",
    "PySpyError",
    "Rules",
    "Stack",
    "VERDICTS",
    "Verdict",
    "analyse_cpu",
    "analyse_gpu",
    "check_pid",
    "decide",
    "diagnose",
    "explain_failure",
    "find_py_spy",
    "image_share",
    "is_image_frame",
    "parse_collapsed",
    "parse_frame",
    "render_text",
    "run_diagnose_command",
    "runnable",
    "thread_samples",
    "top_functions",
    "write_golden_triangle",
    "write_samples",
]
