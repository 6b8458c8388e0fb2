"""Chrome trace format for the phase events a daemon records (`gradsync trace`).

Events arrive as {track, name, start, end, args} with CLOCK_MONOTONIC seconds;
Perfetto and chrome://tracing want complete events ('X') in microseconds, one
thread per track, and metadata events naming the tracks.
"""

from __future__ import annotations

from typing import Any


def chrome_trace(events: list[dict[str, Any]], pid: int) -> dict[str, Any]:
    """Chrome trace JSON: complete events ('X') plus a name for every track."""
    tracks: dict[str, int] = {}
    trace_events: list[dict[str, Any]] = []
    for event in events:
        tid = tracks.setdefault(event["track"], len(tracks) + 1)
        trace_events.append({
            "name": event["name"], "cat": event["track"].split(" ", 1)[0], "ph": "X",
            "ts": event["start"] * 1e6, "dur": (event["end"] - event["start"]) * 1e6,
            "pid": pid, "tid": tid, "args": event.get("args", {}),
        })
    for track, tid in tracks.items():
        trace_events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                             "args": {"name": track}})
    trace_events.append({"name": "process_name", "ph": "M", "pid": pid,
                         "args": {"name": f"gradsyncd {pid}"}})
    return {"traceEvents": trace_events, "displayTimeUnit": "ms"}
