"""A/B workload for issue 21: small and large allreduces in daemon memory."""
import os
import statistics
import sys
import time

import numpy as np

from gradsync.client import Client

small_n, large_n = int(sys.argv[1]), int(sys.argv[2])
with Client() as client:
    small = client.empty(1024, np.float32)   # 4 KiB
    large = client.empty(4 << 20, np.float32)  # 16 MiB
    small[:] = 1.0
    large[:] = 1.0
    times = {"small": [], "large": []}
    for name, array, count in (("small", small, small_n), ("large", large, large_n)):
        client.all_reduce(array)
        for _ in range(count):
            start = time.perf_counter()
            client.all_reduce(array)
            times[name].append(time.perf_counter() - start)
    if os.environ.get("RANK", "0") == "0":
        sys.stdout.write(f"RESULT small_us={statistics.median(times['small']) * 1e6:.1f} "
                         f"large_ms={statistics.median(times['large']) * 1e3:.2f}\n")
