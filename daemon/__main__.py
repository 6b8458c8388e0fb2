"""`python -m gradsync.daemon` runs `gradsyncd`."""

import sys

from gradsync.daemon.main import main

sys.exit(main())
