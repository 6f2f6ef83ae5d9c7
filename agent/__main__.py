"""``python -m agent`` is ``mrc-agent``."""

import sys

from agent.cli import main

sys.exit(main())
