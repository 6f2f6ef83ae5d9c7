"""``python -m mrc_agent.agent`` is ``mrc-agent``."""

import sys

from mrc_agent.agent.cli import main

sys.exit(main())
