"""Log formatting: journald-style when systemd captures stderr, timestamps otherwise.

Under systemd, `$JOURNAL_STREAM` is set; journald adds its own timestamps and
reads a `<N>` prefix (syslog priority) as the line's level.  One line per event.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

_PRIORITIES = {
    logging.DEBUG: 7,
    logging.INFO: 6,
    logging.WARNING: 4,
    logging.ERROR: 3,
    logging.CRITICAL: 2,
}


class JournalFormatter(logging.Formatter):
    """`<priority>name: message`, newlines in the message flattened."""

    def format(self, record: logging.LogRecord) -> str:
        priority = _PRIORITIES.get(record.levelno, 6)
        text = super().format(record).replace("\n", " | ")
        return f"<{priority}>{text}"


def setup_logging(level: str, environ: Mapping[str, str] | None = None) -> None:
    env = os.environ if environ is None else environ
    handler = logging.StreamHandler()
    if env.get("JOURNAL_STREAM"):
        handler.setFormatter(JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter(
            "%(asctime)s gradsyncd[%(process)d] %(levelname)s %(name)s: %(message)s"
        ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
