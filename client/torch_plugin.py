"""torch's plugin hook: `import torch` makes "gradsync" a torch.distributed backend.

gradsync's distribution names `load` under torch's `torch.backends` entry
points, which `import torch` calls, so `init_process_group("gradsync")` (and
`"cpu:gradsync,cuda:nccl"`) works in any process where gradsync is installed,
with no `import gradsync.client.torch` first (Ray Train, config files, ...).

It runs inside `import torch`, so it must be cheap and must never raise: it
registers a creator that imports the backend on the first process group, and
a failure is logged, not raised.  `GRADSYNC_TORCH_AUTOLOAD=0` turns it off
(torch's own `TORCH_DEVICE_BACKEND_AUTOLOAD=0` turns off every such plugin).
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("gradsync.client")

BACKEND = "gradsync"
#: Set to 0 to keep `import torch` from registering the backend.
AUTOLOAD_VARIABLE = "GRADSYNC_TORCH_AUTOLOAD"


def load() -> None:
    """Register the backend with a creator that loads it on first use; never raises."""
    if os.environ.get(AUTOLOAD_VARIABLE, "1") == "0":
        return
    try:
        import torch.distributed as dist

        if not dist.is_available() or BACKEND.upper() in dist.Backend._plugins:
            return
        dist.Backend.register_backend(BACKEND, create, extended_api=True,
                                      devices=["cpu", "cuda"])
    except Exception as exc:  # a broken install must not break `import torch`
        log.warning("gradsync could not register its torch.distributed backend: %s: %s",
                    type(exc).__name__, exc)


def create(backend_opts: Any, backend_options: Any = None) -> Any:
    """torch's creator: the real one, imported now (a process group is being made)."""
    from gradsync.client.torch.backend import _create

    return _create(backend_opts, backend_options)
