"""`python -m gradsync.client.cli`: the `gradsync` command without its console script."""

from __future__ import annotations

import sys

from gradsync.client.cli.main import main

sys.exit(main())
