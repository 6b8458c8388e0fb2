"""Tables of `interdaemon.py`: headline, per placement and M, auto's picks, targets, RESULTS.md.

A "group" is one placement (loopback or netns), one M, one repeat: the
gradsync algorithms, gloo and raw pyzmq measured back to back.  With repeats,
the group other processes disturbed least is reported (by background load,
never by speed).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from benchmarks.daemon_logs import crossovers, model_choice
from benchmarks.plan import (
    CURVE_CONTENDERS,
    FIXED_ALGORITHMS,
    INTERDAEMON_CONTENDERS,
    MIB,
    TITLES,
    algorithm_key,
    format_size,
)
from benchmarks.report import (
    Cell,
    ContenderRun,
    details_table,
    format_bw,
    format_time,
    results_table,
)
from gradsync.daemon.core.auto import auto_candidates
from gradsync.daemon.core.cost_epochs import EPOCH_KEYS

if TYPE_CHECKING:
    from benchmarks.interdaemon import Group

NOTES_BEGIN = (
    "<!-- interdaemon-notes:begin (hand-written; kept when the section is regenerated) -->"
)
NOTES_END = "<!-- interdaemon-notes:end -->"
_NOTES_PLACEHOLDER = (
    "_Not written yet: read the tables above and say what bounds each algorithm._"
)
HEADLINE_SIZES = (MIB, 16 * MIB, 64 * MIB)
#: Targets of the issue: ring >= gloo and >= 70 % of raw pyzmq from 16 MiB; auto within 10 %.
TARGET_FROM = 16 * MIB
RAW_SHARE = 0.70
AUTO_SLACK = 1.10
PLACEMENT_TITLES = {
    "loopback": "127.0.0.1 (loopback)",
    "netns": "network namespaces",
    "shaped": "shaped namespaces",
}


@dataclasses.dataclass
class RunDescription:
    command: str
    started: str
    duration_s: float
    machine: dict[str, str]
    load_average: str
    settings_text: str
    notes: list[str]
    #: (method, record bytes, encrypt GB/s, decrypt GB/s), one core (benchmarks/aead.py).
    aead_rows: list[tuple[str, int, float, float]] = dataclasses.field(default_factory=list)


def select_groups(groups: Sequence[Group]) -> list[Group]:
    """Per placement and M, the repeat with the least background load (failures last)."""

    def badness(group: Group) -> tuple[int, float]:
        runs = [*group.runs, *group.curve_runs]
        failed = (any(run.status == "failed" for run in runs)
                  or (group.raw is not None and group.raw.status == "failed"))
        load = group.background_cores if group.background_cores is not None else float("inf")
        return (1 if failed else 0, load)

    best: dict[tuple[str, int], Group] = {}
    for group in groups:
        key = (group.placement, group.nproc)
        if key not in best or badness(group) < badness(best[key]):
            best[key] = group
    return list(best.values())


def _cell(group: Group, key: str, nbytes: int) -> Cell | None:
    for run in group.runs:
        if run.key == key and run.status != "skipped":
            cell = run.cells.get(nbytes)
            return cell if cell is not None and cell.correct else None
    return None


def _bw(cell: Cell | None) -> str:
    return format_bw(cell.busbw) if cell is not None else "—"


def _raw_at(group: Group, volume: int) -> tuple[float | None, float | None]:
    if group.raw is None:
        return None, None
    return group.raw.stream_gbps(volume), group.raw.ring_gbps(volume)


def _gb(value: float | None) -> str:
    return format_bw(value) if value is not None else "—"


def headline(groups: Sequence[Group], sizes: Sequence[int], algorithms: Sequence[str]) -> str:
    """busbw GB/s per algorithm, gloo and raw pyzmq at 1, 16 and 64 MiB."""
    shown = [s for s in HEADLINE_SIZES if s in sizes] or list(sizes)
    header = ["where", "M", "size", *algorithms, "auto picked", "torch gloo",
              "raw zmq one way", "raw zmq ring exchange"]
    lines = ["| " + " | ".join(header) + " |",
             "|---|---|---|" + "---:|" * len(algorithms) + "---|---:|---:|---:|"]
    for group in groups:
        for nbytes in shown:
            row = [PLACEMENT_TITLES[group.placement], str(group.nproc), format_size(nbytes)]
            row += [_bw(_cell(group, algorithm_key(a), nbytes)) for a in algorithms]
            row.append(group.cluster.picks.picked(nbytes) or "—")
            row.append(_bw(_cell(group, "gloo", nbytes)))
            stream, ring = _raw_at(group, nbytes)
            row += [_gb(stream), _gb(ring)]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def raw_table(group: Group) -> str:
    raw = group.raw
    if raw is None:
        return "_raw pyzmq not measured_"
    if raw.status != "ok":
        return f"_raw pyzmq failed: {raw.note}_"
    lines = ["| raw pyzmq pattern | volume per round | median round | GB/s (per node) |",
             "|---|---:|---:|---:|"]
    for volume in sorted(raw.stream_s):
        gbps = raw.stream_gbps(volume)
        lines.append(f"| one way, node 0 → node 1 | {format_size(volume)} | "
                     f"{format_time(volume / gbps / 1e9) if gbps else '—'} | {_gb(gbps)} |")
    for volume in sorted(raw.ring_s):
        gbps = raw.ring_gbps(volume)
        what = "ring exchange, every node → next" + (
            " (one step's latency floor)" if volume < MIB else ""
        )
        lines.append(f"| {what} | {format_size(volume)} | "
                     f"{format_time(volume / gbps / 1e9) if gbps else '—'} | {_gb(gbps)} |")
    return "\n".join(lines)


def _fastest_fixed(group: Group, nbytes: int, among: Sequence[str]) -> tuple[str, Cell] | None:
    cells = [(a, _cell(group, algorithm_key(a), nbytes)) for a in among]
    present = [(a, c) for a, c in cells if c is not None]
    return min(present, key=lambda item: item[1].time_s) if present else None


#: The algorithms whose model estimates and times the auto table shows.
_ESTIMATED = ("ring", "rhd", "tree", "star")

def auto_table(group: Group, sizes: Sequence[int]) -> str:
    picks = group.cluster.picks
    lines = [
        "| size | auto picked | model estimate ring / rhd / tree / star "
        "| measured ring / rhd / tree / star "
        "| fastest fixed (measured) | auto time | auto / fastest |",
        "|---|---|---|---|---|---:|---:|",
    ]
    for nbytes in sizes:
        estimates = picks.estimates_us.get(nbytes, {})
        est = " / ".join(
            format_time(estimates[a] * 1e-6) if a in estimates else "—" for a in _ESTIMATED
        )
        measured = " / ".join(
            format_time(c.time_s) if (c := _cell(group, algorithm_key(a), nbytes)) else "—"
            for a in _ESTIMATED
        )
        fastest = _fastest_fixed(group, nbytes, FIXED_ALGORITHMS)
        auto = _cell(group, algorithm_key("auto"), nbytes)
        ratio = f"{auto.time_s / fastest[1].time_s:.2f}" if auto and fastest else "—"
        lines.append(
            f"| {format_size(nbytes)} | {picks.label(nbytes) or '—'} | {est} | {measured} | "
            f"{fastest[0] + ' ' + format_time(fastest[1].time_s) if fastest else '—'} | "
            f"{format_time(auto.time_s) if auto else '—'} | {ratio} |"
        )
    return "\n".join(lines)


def model_lines(group: Group, sizes: Sequence[int]) -> list[str]:
    """The model's inputs as the daemons used them, its crossovers, and its agreement."""
    picks = group.cluster.picks
    lines = []
    links = group.cluster.links
    if links:
        rtts = [link.rtt_us for link in links]
        rates = [link.mb_per_s for link in links]
        formed = picks.formed
        job = (f"; the job formed with alpha {formed[0] * 1e6:.0f} µs, "
               f"{1 / formed[1] / 1e9:.2f} GB/s" if formed else "")
        lines.append(
            f"- Link probes when the peers connected ({len(links)} links): rtt "
            f"{min(rtts):.0f} to {max(rtts):.0f} µs, {min(rates):.0f} to {max(rates):.0f} MB/s "
            f"(each daemon announces its shortest rtt / 2 as alpha and 1 / its best rate as "
            f"beta, the job takes the median over daemons{job})."
        )
    if not picks.costs:
        lines.append("- No auto picks in the daemons' statistics: the model's inputs are unknown.")
        return lines
    priced = "; ".join(
        f"{format_size(nbytes)} alpha {alpha * 1e6:.0f} µs, {1 / beta / 1e9:.2f} GB/s"
        for nbytes, (alpha, beta) in sorted(picks.costs.items()) if nbytes in sizes
    )
    lines.append(
        f"- Figures each size was last priced with (from the daemons' statistics; fitted to "
        f"the ring and rhd allreduces run so far, agreed every {EPOCH_KEYS} keys): {priced}. "
        "Gamma is 0. "
        f"The estimates above are the daemon's cost model at those figures (candidates "
        f"{', '.join(auto_candidates(group.nproc))})."
    )
    alpha, beta = picks.costs[max(picks.costs)]  # the last size run: the latest figures
    changes = crossovers(group.nproc, alpha, beta)
    first = model_choice(group.nproc, 4, alpha, beta)
    if first is not None:
        at = f"at the last figures (alpha {alpha * 1e6:.0f} µs, {1 / beta / 1e9:.2f} GB/s)"
        if changes:
            text = ", then ".join(
                f"{new} from {format_size(size) if size % 1024 == 0 else f'{size} B'}"
                for size, _, new in changes
            )
            lines.append(f"- Model's crossovers {at}, 4 B to 1 GiB: {first} below, {text}.")
        else:
            lines.append(f"- Model's choice {at}, 4 B to 1 GiB: always {first}.")
    verdicts = []
    for nbytes in sizes:
        picked = picks.picked(nbytes)
        best = _fastest_fixed(group, nbytes, auto_candidates(group.nproc))
        if picked is None or best is None:
            continue
        chosen = _cell(group, algorithm_key(picked), nbytes) if "/" not in picked else None
        if picked == best[0]:
            verdicts.append(f"{format_size(nbytes)}: agrees ({picked})")
        elif chosen is not None:
            verdicts.append(
                f"{format_size(nbytes)}: picked {picked}, {best[0]} measured faster "
                f"({chosen.time_s / best[1].time_s:.2f}x)"
            )
        else:
            verdicts.append(f"{format_size(nbytes)}: picked {picked} (fastest {best[0]})")
    if verdicts:
        lines.append(f"- auto's settled pick vs the fastest of "
                     f"{'/'.join(auto_candidates(group.nproc))} "
                     "measured: " + "; ".join(verdicts) + ".")
    return lines


def target_lines(groups: Sequence[Group], sizes: Sequence[int]) -> list[str]:
    lines = []
    for group in groups:
        where = f"{PLACEMENT_TITLES[group.placement]}, M={group.nproc}"
        stream, ring_raw = group.raw.best_gbps() if group.raw is not None else (None, None)
        for nbytes in sizes:
            if nbytes < TARGET_FROM:
                continue
            ring = _cell(group, algorithm_key("ring"), nbytes)
            if ring is None:
                lines.append(f"- {where}, {format_size(nbytes)}: ring not measured or WRONG")
                continue
            parts = []
            gloo = _cell(group, "gloo", nbytes)
            if gloo is not None:
                parts.append(
                    f"vs gloo {format_bw(gloo.busbw)}: "
                    f"{'met' if ring.busbw >= gloo.busbw else 'MISSED'} "
                    f"({ring.busbw / gloo.busbw:.2f}x)"
                )
            for label, raw in (("raw ring exchange", ring_raw), ("raw one way", stream)):
                if raw:
                    share = ring.busbw / raw
                    parts.append(
                        f"vs {label} {format_bw(raw)}: {share:.0%} "
                        f"({'met' if share >= RAW_SHARE else 'MISSED'})"
                    )
            lines.append(f"- {where}, {format_size(nbytes)}: ring busbw {format_bw(ring.busbw)} "
                         + ("; ".join(parts) or "(neither gloo nor raw pyzmq measured)"))
        candidates = auto_candidates(group.nproc)
        for among, label in ((FIXED_ALGORITHMS, "fixed algorithm"),
                             (candidates, f"of its candidates {'/'.join(candidates)}")):
            worst = _worst_auto(group, sizes, among)
            if worst is not None:
                verdict = "met" if worst[0] <= AUTO_SLACK else "MISSED"
                lines.append(
                    f"- {where}: auto at most {worst[0]:.2f}x the fastest {label} "
                    f"(worst at {format_size(worst[1])}, vs {worst[2]}): {verdict}"
                )
    return lines


def _worst_auto(
    group: Group, sizes: Sequence[int], among: Sequence[str]
) -> tuple[float, int, str] | None:
    """(auto time / fastest time, size, fastest) at the size where auto fares worst."""
    worst: tuple[float, int, str] | None = None
    for nbytes in sizes:
        auto = _cell(group, algorithm_key("auto"), nbytes)
        best = _fastest_fixed(group, nbytes, among)
        if auto is None or best is None:
            continue
        ratio = auto.time_s / best[1].time_s
        if worst is None or ratio > worst[0]:
            worst = (ratio, nbytes, best[0])
    return worst


def curve_table(groups: Sequence[Group]) -> str | None:
    """Ring over CURVE links against --insecure ones and gloo, per placement, M and size."""
    rows = []
    for group in groups:
        by_key = {run.key: run for run in group.curve_runs}
        gloo = next((run for run in group.runs if run.key == "gloo"), None)
        insecure = by_key.get(CURVE_CONTENDERS[0][0])
        sizes = sorted({n for run in group.curve_runs for n in run.cells})
        for nbytes in sizes:
            for key, title in CURVE_CONTENDERS:
                run = by_key.get(key)
                if run is None:
                    continue
                cell = run.cells.get(nbytes)
                where = (f"| {group.placement} | {group.nproc} | {format_size(nbytes)} | "
                         f"{title}")
                if cell is None or not cell.correct:
                    rows.append(f"{where} | {run.status} {run.note} | — | — | — | — | — |")
                    continue
                busy = f"{cell.cores_busy:.2f}" if cell.cores_busy is not None else "—"
                daemons = f"{cell.daemon_cores:.2f}" if cell.daemon_cores is not None else "—"
                ratios = []
                for base in (insecure, gloo):
                    other = base.cells.get(nbytes) if base is not None else None
                    ratios.append(f"{cell.busbw / other.busbw:.2f}x" if other is not None
                                  and other.correct and other.busbw > 0 else "—")
                rows.append(
                    f"{where} | {format_time(cell.time_s)} | {format_bw(cell.busbw)} | "
                    f"{ratios[0]} | {ratios[1]} | {busy} | {daemons} |"
                )
            gloo_cell = gloo.cells.get(nbytes) if gloo is not None else None
            if gloo_cell is not None and gloo_cell.correct:
                rows.append(f"| {group.placement} | {group.nproc} | {format_size(nbytes)} | "
                            "torch gloo | "
                            f"{format_time(gloo_cell.time_s)} | {format_bw(gloo_cell.busbw)} | "
                            "— | 1.00x | — | — |")
    if not rows:
        return None
    return "\n".join([
        "| where | M | size | ring over | time | busbw GB/s | vs --insecure | vs gloo | "
        "CPU cores busy | of which daemons |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
        *rows,
    ])


#: What the encryption cells are, for both reports.
ENCRYPTION_METHOD = (
    "Encryption: per placement and M, two fresh clusters back to back, one with "
    "`--insecure`, one with CURVE keys from `gradsync keygen` (`--curve-secret`, "
    "`--curve-authorized`), ring at 16 and 64 MiB. Both take the data streams: plaintext "
    "with `--insecure`, AEAD records with CURVE (AES-256-GCM where both daemons' CPUs "
    "have AES instructions, else ChaCha20-Poly1305; keys agreed over CURVE), so the "
    "difference is the encryption; gloo's row is the same group's gloo run. The AEAD "
    "rows: one core, the same run; the *AES-NI masked* rows run OpenSSL with "
    "`OPENSSL_ia32cap` clearing AES-NI, PCLMULQDQ, VAES and VPCLMULQDQ (other flags "
    "kept), as on a CPU without AES instructions."
)
#: Targets of issue 22: CURVE ring busbw at least this share of --insecure's, and gloo's.
CURVE_VS_INSECURE = 0.8
CURVE_VS_GLOO = 1.0


def curve_target_lines(groups: Sequence[Group]) -> list[str]:
    """Per cell, CURVE ring busbw against the targets (0.8x --insecure, 1.0x gloo)."""
    lines = []
    insecure_key, curve_key = (key for key, _ in CURVE_CONTENDERS)
    for group in groups:
        by_key = {run.key: run for run in group.curve_runs}
        gloo = next((run for run in group.runs if run.key == "gloo"), None)
        curve = by_key.get(curve_key)
        if curve is None:
            continue
        for nbytes in sorted(curve.cells):
            cell = curve.cells[nbytes]
            if not cell.correct:
                continue
            verdicts = []
            for name, base, share in (("--insecure", by_key.get(insecure_key),
                                       CURVE_VS_INSECURE), ("gloo", gloo, CURVE_VS_GLOO)):
                other = base.cells.get(nbytes) if base is not None else None
                if other is None or not other.correct or other.busbw <= 0:
                    verdicts.append(f"vs {name}: not measured")
                    continue
                ratio = cell.busbw / other.busbw
                verdicts.append(f"{ratio:.2f}x {name} ({'met' if ratio >= share else 'MISSED'}"
                                f", target {share:g}x)")
            lines.append(f"- {PLACEMENT_TITLES[group.placement]}, M = {group.nproc}, "
                         f"{format_size(nbytes)}: CURVE {format_bw(cell.busbw)} GB/s, "
                         + "; ".join(verdicts))
    return lines


def render_encryption(
    run: RunDescription, groups: Sequence[Group], all_groups: Sequence[Group]
) -> str:
    """The "interdaemon-encryption" section of RESULTS.md (`--encryption-only`)."""
    out = _preamble(run, "Inter-daemon encryption cost: ring over CURVE vs --insecure vs "
                         "torch gloo")
    add = out.append
    add(f"Everything shares this machine's {os.cpu_count()} CPUs (daemons, ranks, both ends "
        "of every TCP connection): the numbers measure CPU cost per byte, not a network.\n")
    out += _machine(run)
    add("## Method\n")
    add("M nodes, one `gradsyncd` each, one rank per daemon, float32 sum ring allreduce in "
        f"place on `Client.empty()` buffers, checked before and after timing. "
        f"{run.settings_text}. time = median over samples of the slowest rank's time per "
        "op; busbw = bytes / time · 2(M−1)/M.\n")
    add(f"- {ENCRYPTION_METHOD}\n")
    ciphers = sorted({c for group in groups for info in group.curve_cluster
                      for c in info.ciphers if info.label == "gradsync-curve"})
    add(f"- The CURVE clusters' streams were sealed with: {', '.join(ciphers) or 'unknown'} "
        "(the daemons' stream-open log lines).\n")
    for line in run.notes:
        add(f"- Note: {line}")
    if run.notes:
        add("")
    table = curve_table(groups)
    add("## Ring over CURVE vs --insecure vs gloo\n")
    add(table or "_nothing measured_")
    add("")
    add(f"Targets: CURVE busbw at least {CURVE_VS_INSECURE:g}x `--insecure`'s and "
        f"{CURVE_VS_GLOO:g}x gloo's in every cell.\n")
    add("\n".join(curve_target_lines(groups)) or "- not measured in this run")
    add("")
    aead = aead_table(run.aead_rows)
    if aead:
        add("## Raw AEAD throughput, one core, same run\n")
        add(aead)
        add("")
    out += _problems(all_groups)
    add("### Background load\n")
    add(load_table(all_groups, groups))
    add("")
    add("### Daemon command lines (daemon 0 of each cluster)\n")
    for group in groups:
        for info in group.curve_cluster:
            if info.commands:
                add(f"- {PLACEMENT_TITLES[group.placement]}, M = {group.nproc}, "
                    f"{info.label}: `{info.commands[0]}`")
    add("")
    return "\n".join(out)


def aead_table(rows: Sequence[tuple[str, int, float, float]]) -> str | None:
    """The raw AEAD throughput of the run, one core."""
    if not rows:
        return None
    lines = ["| method (one core) | record | encrypt GB/s | decrypt GB/s |", "|---|---:|---:|---:|"]
    lines += [f"| {method} | {format_size(size)} | {enc:.2f} | {dec:.2f} |"
              for method, size, enc, dec in rows]
    return "\n".join(lines)


def load_table(all_groups: Sequence[Group], selected: Sequence[Group]) -> str:
    chosen = {id(group) for group in selected}
    lines = ["| where | M | repeat | gradsync wall | waited for quiet | "
             "background load (cores) | in the tables |",
             "|---|---|---:|---:|---:|---:|---|"]
    for group in all_groups:
        wall = max((run.wall_s for run in [*group.runs, *group.curve_runs]
                    if run.key.startswith("gradsync")), default=0.0)
        load = f"{group.background_cores:.2f}" if group.background_cores is not None else "—"
        lines.append(
            f"| {PLACEMENT_TITLES[group.placement]} | {group.nproc} | {group.repeat} | "
            f"{wall:.0f} s | {group.quiet_wait_s:.0f} s | {load} | "
            f"{'yes' if id(group) in chosen else ''} |"
        )
    return "\n".join(lines)


def failures(groups: Sequence[Group]) -> list[str]:
    """Failed contenders, wrong results, daemons that leaked or exited badly (any repeat)."""
    lines = []
    for group in groups:
        where = f"{group.placement}, M={group.nproc}, repeat {group.repeat}"
        for run in [*group.runs, *group.curve_runs]:
            if run.status == "failed":
                lines.append(f"- {where}: {TITLES.get(run.key, run.key)} failed: {run.note}")
            for cell in run.cells.values():
                if not cell.correct:
                    lines.append(f"- {where}: {TITLES.get(run.key, run.key)}, "
                                 f"{format_size(cell.nbytes)}: WRONG RESULT: {cell.wrong_detail}")
        clusters = [group.cluster, *group.curve_cluster]
        for info in clusters:
            lines += [f"- {where}: {problem}" for problem in info.problems]
        if group.raw is not None and group.raw.status != "ok":
            lines.append(f"- {where}: raw pyzmq failed: {group.raw.note}")
    return lines


def _sorted_runs(group: Group) -> list[ContenderRun]:
    order = {key: i for i, (key, _) in enumerate(INTERDAEMON_CONTENDERS)}
    return sorted(group.runs, key=lambda run: order.get(run.key, len(order)))


def console(
    groups: Sequence[Group], sizes: Sequence[int], algorithms: Sequence[str],
    aead_rows: Sequence[tuple[str, int, float, float]] = (),
) -> str:
    out = ["", "### Headline: busbw GB/s", "", headline(groups, sizes, algorithms), ""]
    for group in groups:
        out += [f"### {PLACEMENT_TITLES[group.placement]}, M = {group.nproc}", "",
                results_table(group.runs, sizes, group.nproc, INTERDAEMON_CONTENDERS), "",
                raw_table(group), "", auto_table(group, sizes), ""]
    table = curve_table(groups)
    if table:
        out += ["### Encryption", "", table, ""]
    aead = aead_table(aead_rows)
    if aead:
        out += [aead, ""]
    out += ["### Targets", "", *target_lines(groups, sizes), ""]
    return "\n".join(out)


def _preamble(run: RunDescription, title: str) -> list[str]:
    """A section's title, when it was recorded and the command that reproduces it."""
    return [f"# {title}\n",
            f"Recorded {run.started}, {run.duration_s:.0f} s in all. Reproduce from the "
            "repository root (venv active, as root for the network namespaces):\n",
            f"```\n{run.command}\n```\n"]


def _machine(run: RunDescription) -> list[str]:
    return ["## Machine\n", *(f"- {label}: {value}" for label, value in run.machine.items()),
            f"- load average at the start: {run.load_average}", ""]


def _problems(all_groups: Sequence[Group]) -> list[str]:
    issues = failures(all_groups)
    return ["## Problems in this run\n", "\n".join(issues), ""] if issues else []


def render(
    run: RunDescription,
    groups: Sequence[Group],
    all_groups: Sequence[Group],
    sizes: Sequence[int],
    algorithms: Sequence[str],
    notes: str | None,
) -> str:
    """The "interdaemon" section of RESULTS.md."""
    out = _preamble(run, "Inter-daemon allreduce: ring, tree, rhd, star, auto vs torch gloo "
                         "vs raw pyzmq")
    add = out.append
    cpus = os.cpu_count()
    add(
        f"**Everything shares this machine's {cpus} CPUs**: every daemon (event loop, ZeroMQ "
        "I/O thread, reduce threads), every rank, the kernel's TCP stack on both ends of "
        "every connection. No byte crosses a NIC, so these numbers measure CPU cost per "
        "byte and per message (copies, syscalls, wake-ups), not a network. On real nodes "
        "each daemon has its own cores and the wire sets the pace: the *shaped namespaces* "
        "rows (where run) cap every node's link with a token bucket, so there the wire, "
        "not the CPUs, is the bottleneck.\n"
    )
    out += _machine(run)
    add("## Method\n")
    add(
        "M nodes, one `gradsyncd` each, one rank per daemon (RANK, WORLD_SIZE = M, "
        "LOCAL_WORLD_SIZE = 1, GRADSYNC_DAEMON = its node's daemon), so every byte of "
        "the allreduce crosses the daemons' peer links. float32 sum, in place, buffers from "
        "`Client.empty()`. Per size the algorithms take turns (ring, tree, rhd, star, auto: "
        "`all_reduce(buf, algorithm=...)`), each with a correctness check before and after "
        "timing (rank r contributes (r + 1) + i mod 13; every element is compared with the "
        "exact sum), a warm-up, and samples of k back-to-back ops after a barrier "
        f"(a one-element allreduce). {run.settings_text}. time = median over samples of the "
        "slowest rank's sample time / k; algbw = bytes / time; busbw = algbw · 2(M−1)/M.\n"
    )
    add(
        "- torch gloo: one process per node, `init_process_group('gloo')` through a file "
        "store, GLOO_SOCKET_IFNAME = the node's interface, `all_reduce` on "
        "`torch.from_numpy` views; same sizes and method.\n"
        "- raw pyzmq: one process per node on the same addresses (its own sockets, no "
        "daemon running), ROUTER bound, "
        "DEALER to the next node, as the daemons' links are; 1 MiB frames sent zero-copy. "
        "*One way*: node 0 streams to node 1, which answers when all arrived. *Ring "
        "exchange*: every node sends to the next while receiving from the previous, the "
        "traffic of a ring step without reduction; GB/s per node, slowest node per round. "
        "A ring allreduce's busbw is exactly its per-daemon send rate, so the ring exchange "
        "is its ceiling on these links; one way (only one sender busy) is the optimistic "
        "one.\n"
        "- auto's picks: read from each daemon's statistics (`gradsync stats --json`, job "
        "entry `auto`: per size, how often each algorithm was picked, on which basis, the "
        "latest pick and the figures it was priced with last) before the daemons stop; "
        "\"auto picked\" is the latest pick (what auto settled on). A job's first "
        "collectives are priced with the link probes; from then on every daemon fits alpha "
        "and beta to the ring and rhd allreduces it ran, times every algorithm per size, and "
        f"the members agree on the medians every {EPOCH_KEYS} keys (daemon/cost_epochs.py); "
        "algorithms the model prices within 1.5x of its best are each timed, then the "
        "fastest measured runs. Here the fixed algorithms' own runs in the same job feed "
        "those timings, so auto rarely needs to explore; a job running only auto times each "
        "contender itself, an epoch at a time (tests/test_multinode.py).\n"
        f"- {ENCRYPTION_METHOD}\n"
    )
    for line in run.notes:
        add(f"- Note: {line}")
    if run.notes:
        add("")
    add("## Headline (busbw GB/s)\n")
    add(headline(groups, sizes, algorithms))
    add("")
    add("raw zmq columns: the same volume streamed (one way) or exchanged around the ring "
        "(GB/s per node) between the same addresses; — where that volume was not measured.\n")
    add("## Targets\n")
    add("Ring busbw from 16 MiB: at least gloo's, and at least 70 % of raw pyzmq between the "
        "same endpoints (best volume); auto: never more than 10 % slower than the fastest "
        "fixed algorithm at any size.\n")
    add("\n".join(target_lines(groups, sizes)) or "- not measured in this run")
    add("")
    table = curve_table(groups)
    if table:
        add("## Encryption cost (CURVE vs --insecure vs gloo)\n")
        add(table)
        add("")
    aead = aead_table(run.aead_rows)
    if aead:
        add(aead)
        add("")
    out += _problems(all_groups)
    for group in groups:
        add(f"## {PLACEMENT_TITLES[group.placement]}, M = {group.nproc}\n")
        add(f"{group.description}.\n")
        add(results_table(group.runs, sizes, group.nproc, INTERDAEMON_CONTENDERS))
        add("")
        add(raw_table(group))
        add("")
        add("### auto\n")
        add(auto_table(group, sizes))
        add("")
        add("\n".join(model_lines(group, sizes)))
        add("")
    add("## Diagnostics\n")
    add(
        "CPU cores busy = CPU seconds of all ranks and all daemons during the timed samples, "
        f"per wall second (the machine has {cpus}); of which daemons = the daemons' share. "
        "Every algorithm of a size ran in the same processes, one after the other.\n"
    )
    for group in groups:
        add(f"### {PLACEMENT_TITLES[group.placement]}, M = {group.nproc}\n")
        add(details_table(_sorted_runs(group), sizes, group.nproc))
        add("")
    add("### Background load\n")
    add("Before each placement and M the run waits (up to --quiet-wait-s) for other processes "
        "to drop below 0.25 cores; background load = machine-wide busy CPU minus this "
        "benchmark's own, over the whole group.\n")
    add(load_table(all_groups, groups))
    add("")
    add("### Daemon command lines (daemon 0 of each cluster)\n")
    for group in groups:
        clusters = [group.cluster, *group.curve_cluster]
        for info in clusters:
            if info.commands:
                add(f"- {PLACEMENT_TITLES[group.placement]}, M = {group.nproc}, "
                    f"{info.label}: `{info.commands[0]}`")
    add("")
    add("## What limits it\n")
    add(NOTES_BEGIN)
    add(notes if notes else _NOTES_PLACEHOLDER)
    add(NOTES_END)
    add("")
    return "\n".join(out)


__all__ = ["RunDescription", "TITLES", "console", "failures", "render", "render_encryption",
           "select_groups"]
