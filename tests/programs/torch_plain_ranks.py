"""A torch program that never imports gradsync and hands torch its rank itself.

As Lightning's first process does, it passes `rank=` and `world_size=` to
`init_process_group` with no RANK in its environment (it takes its rank from
RANK and then removes it); the backend "gradsync" must come from torch's
plugin entry point alone.  argv[1]: the init method.  Prints one JSON line.
"""

import datetime
import json
import os
import sys

RANK = int(os.environ.pop("RANK"))
WORLD = int(os.environ["WORLD_SIZE"])
for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
    os.environ.pop(name, None)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

registered = "gradsync" in dist.Backend.backend_list
loaded_before = sorted(m for m in sys.modules if m.startswith("gradsync.client.torch."))
dist.init_process_group("gradsync", init_method=sys.argv[1], rank=RANK, world_size=WORLD,
                        timeout=datetime.timedelta(seconds=60))
tensor = torch.full((1024,), float(RANK + 1))
dist.all_reduce(tensor)
gathered: list[object] = [None] * WORLD
dist.all_gather_object(gathered, {"rank": RANK, "text": "x" * (RANK * 100)})
broadcast: list[object] = [{"from": RANK, "values": list(range(5))}]
dist.broadcast_object_list(broadcast, src=WORLD - 1)
dist.destroy_process_group()
print(json.dumps({
    "rank": RANK,
    "registered": registered,
    "loaded_before_init": loaded_before,
    "sum": float(tensor[0]),
    "gathered": gathered,
    "broadcast": broadcast,
}), flush=True)
