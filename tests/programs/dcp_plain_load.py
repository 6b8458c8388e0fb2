"""Load a persisted checkpoint with plain DCP, in a process that cannot import gradsync.

Run as `TORCH_DEVICE_BACKEND_AUTOLOAD=0 python -S dcp_plain_load.py SITE DIR [--fsdp]`:
`-S` skips site-packages' .pth files (where the editable install of gradsync
hooks in), SITE is added by hand for torch, and torch's autoload of installed
backends is off (a machine without gradsync has no such entry point).  Prints one
JSON line: the loaded state flattened (persist_state.flatten).
"""

import importlib.util
import json
import sys

sys.path.append(sys.argv[1])
assert importlib.util.find_spec("gradsync") is None, "gradsync is importable here"

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from persist_state import flatten, make_model, train_step  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402

fsdp = "--fsdp" in sys.argv
model = make_model(fsdp)
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
train_step(model, optimizer, 0, 0, 8 if fsdp else 16)  # the optimizer's state entries exist
model_state, optim_state = get_state_dict(model, optimizer)
state = {"model": model_state, "optim": optim_state, "step": torch.tensor(-1)}
dcp.load(state, storage_reader=FileSystemReader(sys.argv[2]), no_dist=True)
gradsync = sorted(name for name in sys.modules if name.split(".")[0] == "gradsync")
print(json.dumps({"state": flatten(state), "gradsync_modules": gradsync}), flush=True)
