"""Turn bench_save's figures into ratios, targets and PASS/FAIL, then Markdown and JSON.

Every ratio is computed from figures of the same run. ``ours ÷ limit`` and ``ours ÷ best peer`` are
plain quotients of the displayed values (for times lower is better, for GB/s higher is better).
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Callable

from _common import MiB, gbps, num

PEERS = {"torch_save": "torch.save", "lightning": "Lightning AsyncCheckpointIO",
         "dcp_save": "DCP save", "dcp_async": "DCP async_save"}
ORDER = ("memcpy", "memcpy_threads", "raw_write", "raw_write_direct", "raw_read", "ours", *PEERS)
LOAD_PEERS = {"torch_save": "torch.load", "dcp_save": "DCP load"}
Agg = dict[str, dict[str, float]]
MEM_SLACK_MIB = 4
"""Allowance over the snapshot buffer for interpreter and metadata noise (manifest JSON, records)."""


NOTES = (
    "Notes:",
    "- Ours: best of saves 2..N (first save apart); time to committed = `save()` call until `wait()` returns "
    "(on rank 0 it includes deleting the previous checkpoint, `keep_last=1`). Limits: best of the same "
    "repetitions, memcpy / raw write timed right next to each save, raw writes and save in rotating order. "
    "The stall target: each save ÷ the mean of the threaded copies timed right before and right after it, "
    "the median over saves 2..N (slowest rank's figures).",
    "- Peers: best of their rounds (the first is cold: free heap handed back; RSS figures come from it). "
    "Peer persist GB/s = (state bytes ÷ ranks) ÷ time to durable, the same rank-share figure as ours. "
    "`torch.save` and Lightning run on rank 0 only; Lightning's total includes an `fsync` after `teardown()`.",
    "- Restores return new tensors, so they pay first-touch page faults; the limit is a raw read into a freshly "
    "allocated buffer. Cold: every file of the contender `fsync`ed and dropped from the page cache "
    "(`posix_fadvise(DONTNEED)`) before each load; warm: read through once before. Best of the peer rounds. "
    "The restore target: per round, one `load()`, one raw read into fresh memory and the same read hashed "
    "with xxh3 a MiB at a time as `load()` verifies, right after each other (the order rotating; the raw reads "
    "on the rank's cores, into 4 KiB or huge pages, whichever read faster before the rounds), "
    "the median over the rounds of raw time ÷ ours (slowest rank); raw ÷ verified raw is the most a restore "
    "that checks every byte can reach. The persist target is paired the same way: "
    "per round, the faster raw write + fsync ÷ our time after the stall (saves 2..N, slowest rank's figures).",
    f"- Memory: peak RSS growth (VmHWM after `malloc_trim` and a reset); {MEM_SLACK_MIB} MiB allowed for "
    "interpreter and metadata noise.",
)


@dataclass
class Row:
    """One line of the table: a figure of ours next to its physical limit and its best peer."""

    world: str
    metric: str
    unit: str
    ours: float
    limit: float
    limit_name: str
    peer: float | None
    peer_name: str
    target: str
    passed: bool | None

    @property
    def vs_limit(self) -> float:
        return self.ours / self.limit if self.limit else float("nan")

    @property
    def vs_peer(self) -> float:
        return self.ours / self.peer if self.peer else float("nan")


def _best(values: dict[str, float], lower_is_better: bool) -> tuple[str, float | None]:
    if not values:
        return "-", None
    name = (min if lower_is_better else max)(values, key=values.__getitem__)
    return name, values[name]


def _row(world: str, metric: str, unit: str, ours: float, limit: tuple[str, float], peers: dict[str, float],
         lower_is_better: bool, target: str, check: Callable[[float, float], bool] | None) -> Row:
    """A row whose ``check(ours, limit)`` decides PASS/FAIL (``None``: informative only)."""
    peer_name, peer = _best(peers, lower_is_better)
    return Row(world, metric, unit, ours, limit[1], limit[0], peer, peer_name, target,
               None if check is None else check(ours, limit[1]))


def world_rows(world: int, agg: Agg) -> list[Row]:
    """Stall, time to committed, persist throughput, restore throughput and memory for one world size."""
    w, ours, total = str(world), agg["ours"], agg["state"]["bytes"]
    persist_ratio = paired_persist(agg)
    share = ours["share_bytes"]
    stall_peers = {PEERS[p]: agg[p]["stall_s"] * 1e3 for p in PEERS if "stall_s" in agg[p]}
    # The copy limit, measured both ways: one memmove, and the same bytes split over the rank's cores.
    copies = [("memcpy of share, 1 thread", agg["memcpy"]["stall_s"] * 1e3)]
    if "memcpy_threads" in agg:
        n = int(agg["memcpy_threads"]["threads"])
        copies.append((f"memcpy of share, {n} thread{'s' if n > 1 else ''}",
                       agg["memcpy_threads"]["stall_s"] * 1e3))
    memcpy = min(copies, key=lambda c: c[1])
    # The write limit: the faster of a buffered and a direct (O_DIRECT) raw write of the same bytes.
    kinds = [("raw write+fsync", agg["raw_write"])]
    if "raw_write_direct" in agg:
        kinds.append(("raw O_DIRECT write+fsync", agg["raw_write_direct"]))
    raw_name, raw_w = min(kinds, key=lambda k: k[1]["total_s"])
    first_name, raw_first = min(kinds, key=lambda k: k[1]["total_first_s"])
    return [
        _row(w, "stall, steady state (best of saves 2..N)", "ms", ours["stall_s"] * 1e3, memcpy, stall_peers,
             True, "info", None),
        *paired_stall(w, agg),
        _row(w, "stall, first save", "ms", ours["stall_first_s"] * 1e3, memcpy, stall_peers, True, "info", None),
        _row(w, "time to committed (steady)", "s", ours["total_s"], (raw_name, raw_w["total_s"]),
             {PEERS[p]: agg[p]["total_s"] for p in PEERS if "total_s" in agg[p]}, True, "info", None),
        _row(w, "time to committed, first save", "s", ours["total_first_s"],
             (f"{first_name}, first", raw_first["total_first_s"]), {}, True, "info", None),
        _row(w, "persist throughput of rank share (after the stall)", "GB/s",
             gbps(share, ours.get("after_stall_s", ours["total_s"])),
             (raw_name, gbps(raw_w["bytes"], raw_w["total_s"])),
             {PEERS[p]: gbps(total // world, agg[p]["total_s"]) for p in PEERS if "total_s" in agg[p]},
             False, *(("info", None) if persist_ratio is not None else
                      ("≥ 0.90 × limit", lambda o, lim: o >= 0.90 * lim))),
        *paired_persist_rows(w, persist_ratio),
        *restore_rows(w, agg, total),
        _row(w, "peak extra host memory (1 in-flight snapshot)", "MiB", ours["mem_extra_bytes"] / MiB,
             ("rank share", share / MiB),
             {PEERS[p]: agg[p]["mem_extra_bytes"] / MiB for p in PEERS if "mem_extra_bytes" in agg[p]},
             True, f"≤ 1.00 × limit + {MEM_SLACK_MIB} MiB", lambda o, lim: o <= lim + MEM_SLACK_MIB),
    ]


def paired_stall(w: str, agg: Agg) -> list[Row]:
    """The stall target: the median over saves 2..N of each stall ÷ the threaded copy of the same
    bytes timed next to it (the slowest rank's), robust to the machine's drift between saves. Since
    2026-11-26 (38ba48b) the copy runs on both sides of every save and the save is judged against their
    mean, each side's median shown beside it; runs of 2026-11-26 before it alternated the side (before
    the save in even repetitions, after it in odd ones), earlier runs timed it always before."""
    if "paired" not in agg:
        return []
    paired = agg["paired"]
    sides = (("before", "copy right before the save", "pairs"), ("after", "copy right after it", "pairs"))
    label = "on both sides of it (their mean"
    if "stall_vs_copy_median_before" not in paired:
        sides = (("limit_first", "copy right before the save", "pairs_limit_first"),
                 ("save_first", "copy right after it", "pairs_save_first"))
        label = "next to it (" + ("both orders" if "stall_vs_copy_median_save_first" in paired else "copy first")
    rows = [_row(w, f"stall ÷ copy on the rank's cores {label}, median of saves 2..N)", "×",
                 paired["stall_vs_copy_median"], ("same bytes, same moment", 1.0), {}, True, "≤ 1.10 × limit",
                 lambda o, lim: o <= 1.10 * lim)]
    for key, side, count in sides:
        if f"stall_vs_copy_median_{key}" in paired:
            n = int(paired[count])
            rows.append(_row(w, f"of which against the {side} alone ({n} save{'s' if n != 1 else ''})", "×",
                             paired[f"stall_vs_copy_median_{key}"], ("same bytes, same moment", 1.0), {}, True,
                             "info", None))
    if "snapshot_vs_copy_median" in paired:
        rows.append(_row(w, "of which the copy alone (the snapshot inside `save()`: no encoding, planning or "
                            "hand-over) ÷ the same mean", "×", paired["snapshot_vs_copy_median"],
                         ("same bytes, same moment", 1.0), {}, True, "info", None))
    return rows


def persist_ratios(agg: Agg) -> list[float]:
    """The persist target's pairs: per round 2..N, the faster raw write + fsync of the round
    (buffered or ``O_DIRECT``; each round runs the raw writes and our save back to back, in rotating
    order) ÷ our time after the stall in that round; empty without per-round figures. Pure."""
    ours, buffered, direct = agg["ours"], agg.get("raw_write", {}), agg.get("raw_write_direct", {})
    rounds = itertools.takewhile(lambda i: f"rep{i}_after_stall_s" in ours, itertools.count(2))
    return [min(buffered[f"rep{i}_s"], direct[f"rep{i}_s"]) / ours[f"rep{i}_after_stall_s"] for i in rounds
            if f"rep{i}_s" in buffered and f"rep{i}_s" in direct]


def paired_persist(agg: Agg) -> float | None:
    """The persist target, paired like the stall's: the median of :func:`persist_ratios`; ``None``
    without per-round figures. One save's disk time drifts 1.0-1.8 s per GiB here from round to
    round, so two best-of figures mostly say which side was lucky."""
    ratios = persist_ratios(agg)
    return statistics.median(ratios) if ratios else None


def paired_persist_rows(w: str, ratio: float | None) -> list[Row]:
    """The row of :func:`paired_persist`'s ``ratio``, when the run has its figures."""
    if ratio is None:
        return []
    return [_row(w, "persist ÷ raw write + fsync of the same round (median of saves 2..N)", "×", ratio,
                 ("same bytes, same round", 1.0), {}, False, "≥ 0.90 × limit", lambda o, lim: o >= 0.90 * lim)]


def restore_rows(w: str, agg: Agg, total: int) -> list[Row]:
    """``load()`` of the whole state, files out of the page cache and in it: against a raw read into
    fresh memory (the same page faults) and against ``torch.load``; with several ranks, the
    collective ``restore()`` by each route."""
    ours, raw_r = agg["ours"], agg["raw_read"]
    rows = []
    for cache, key, raw_key in (("cold", "load_s", "load_fresh_s"), ("warm", "load_warm_s", "load_fresh_warm_s")):
        if key not in ours or raw_key not in raw_r:
            continue
        peers = {f"{LOAD_PEERS[p]} ({cache})": gbps(total, agg[p][key]) for p in LOAD_PEERS if key in agg[p]}
        paired = agg.get("paired", {}).get(f"restore_vs_raw_{cache}_median")
        rows += [
            _row(w, f"restore throughput, {cache} page cache (best of rounds)", "GB/s", gbps(total, ours[key]),
                 (f"raw read into fresh buffer ({cache})", gbps(raw_r["bytes"], raw_r[raw_key])), peers,
                 False, "info" if paired is not None else "≥ 0.90 × limit",
                 None if paired is not None else lambda o, lim: o >= 0.90 * lim),
            *([] if paired is None else [
                _row(w, f"restore ÷ raw read into fresh memory just before or after it, {cache} (median of rounds)",
                     "×", 1 / paired, ("same bytes, same moment", 1.0), {}, False, "≥ 0.90 × limit",
                     lambda o, lim: o >= 0.90 * lim)]),
            *verified_rows(w, agg.get("paired", {}), cache),
            _row(w, f"restore throughput ÷ torch.load, {cache}", "GB/s", gbps(total, ours[key]),
                 (f"torch.load ({cache})", gbps(total, agg["torch_save"][key])), peers,
                 False, "≥ 1.00 × torch.load", lambda o, lim: o >= lim),
        ]
    rows.append(_row(w, "restore throughput vs raw read into a warm buffer", "GB/s", gbps(total, ours["load_warm_s"]
                                                                                     if "load_warm_s" in ours
                                                                                     else ours["load_s"]),
                     ("raw read (page cache, warm buffer)", gbps(raw_r["bytes"], raw_r["load_s"])), {}, False,
                     "info", None))
    if "restore_exchange_s" in ours:
        chose = "exchange" if ours.get("auto_exchanged") else "read"
        rows.append(_row(w, "collective restore, cold: each rank reads 1/N + exchange", "GB/s",
                         gbps(total, ours["restore_exchange_s"]),
                         ("every rank reads everything", gbps(total, ours["restore_read_s"])),
                         {f"auto (chose {chose})": gbps(total, ours["restore_auto_s"])}, False, "info", None))
    return rows


def verified_rows(w: str, paired: dict[str, float], cache: str) -> list[Row]:
    """Informative: what checking every byte costs a raw read here (the raw read hashed as
    ``load()`` hashes, the cap of the restore target), and our restore against that read."""
    cap, ours = paired.get(f"verified_vs_raw_{cache}_median"), paired.get(f"restore_vs_verified_{cache}_median")
    if cap is None or ours is None:
        return []
    return [_row(w, f"raw read + xxh3 of every MiB ÷ raw read, {cache}: the most a verified restore reaches "
                 "(median of rounds)", "×", 1 / cap, ("same bytes, same moment", 1.0), {}, False, "info", None),
            _row(w, f"restore ÷ raw read + xxh3 of every MiB, {cache} (median of rounds)", "×", 1 / ours,
                 ("same bytes, same moment", 1.0), {}, False, "info", None)]


def fastest_copy(agg: Agg) -> float:
    """Seconds of the rank's fastest copy of its share: one ``memmove``, or split over its cores."""
    return min(agg[k]["stall_s"] for k in ("memcpy", "memcpy_threads") if k in agg)


def scaling_row(one: Agg, two: Agg) -> Row:
    """2-rank slowest-rank stall ÷ 1-rank stall, against how the machine's fastest copy of each
    rank's share scales the same way. Slicing divides the bytes each rank copies, but on one node
    the ranks also divide the cores, and a single rank already copies on all of them, so a stall
    can only scale as that copy does (a fixed ≤ 0.60 assumed a single-threaded copy at 1 rank)."""
    peers = {PEERS[p]: two[p]["stall_s"] / one[p]["stall_s"] for p in PEERS if "stall_s" in one[p]}
    ours = two["ours"]["stall_s"] / one["ours"]["stall_s"]
    return _row("2 vs 1", "stall scaling (2-rank slowest ÷ 1-rank)", "×", ours,
                ("fastest copy's scaling", fastest_copy(two) / fastest_copy(one)), peers, True,
                "≤ 1.10 × limit", lambda o, lim: o <= 1.10 * lim)


def all_rows(worlds: dict[int, dict[str, Any]]) -> list[Row]:
    rows = [row for w, res in worlds.items() for row in world_rows(w, res["slowest"])]
    if 1 in worlds and 2 in worlds:
        rows.append(scaling_row(worlds[1]["slowest"], worlds[2]["slowest"]))
    return rows


def markdown(rows: list[Row], worlds: dict[int, dict[str, Any]], config: dict[str, Any]) -> str:
    """The headline table, then every contender's raw figures per world size."""
    head = ("| ranks | metric | unit | ours | physical limit | ours ÷ limit | best peer | ours ÷ best peer "
            "| target | result |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [f"# bench_save: {config['size_mib']} MiB state, {config['cpu_count']} cores, torch {config['torch']}",
             "", "Slowest rank of each world size; reads come from the page cache (nothing is dropped).", "", head]
    for r in rows:
        verdict = "info" if r.passed is None else ("PASS" if r.passed else "FAIL")
        lines.append(f"| {r.world} | {r.metric} | {r.unit} | {num(r.ours)} | {r.limit_name}: {num(r.limit)} "
                     f"| {num(r.vs_limit)} | {r.peer_name}: {num(r.peer)} | {num(r.vs_peer)} | {r.target} "
                     f"| {verdict} |")
    lines += ["", *NOTES, ""]
    lines += contender_table(worlds)
    return "\n".join(lines) + "\n"


def contender_table(worlds: dict[int, dict[str, Any]]) -> list[str]:
    """Raw figures of every contender (slowest rank), in ms / s / MiB."""
    lines = ["| ranks | contender | stall ms | to durable s | restore s (cold) | restore s (warm) | extra RSS MiB "
             "| restore bit-exact |", "|---|---|---|---|---|---|---|---|"]
    for w, res in worlds.items():
        for name in ORDER:
            m = res["slowest"].get(name, {})
            stall = m.get("stall_s")
            ok = {1.0: "yes", 0.0: "NO"}.get(m.get("load_ok", -1), "-")
            lines.append(f"| {w} | {name} | {num(stall * 1e3 if stall is not None else None)} "
                         f"| {num(m.get('total_s'))} | {num(m.get('load_s'))} | {num(m.get('load_warm_s'))} "
                         f"| {num(m['mem_extra_bytes'] / MiB if 'mem_extra_bytes' in m else None)} | {ok} |")
            if "load_fresh_s" in m:
                lines.append(f"| {w} | {name} (into fresh buffer) | - | - | {num(m['load_fresh_s'])} "
                             f"| {num(m.get('load_fresh_warm_s'))} | - | - |")
            for route in ("read", "exchange", "auto"):
                if f"restore_{route}_s" in m:
                    lines.append(f"| {w} | {name} restore(), route {route} | - | - "
                                 f"| {num(m[f'restore_{route}_s'])} | - | - | - |")
    return lines


def _finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None


def write_report(worlds: dict[int, dict[str, Any]], config: dict[str, Any], out: str) -> str:
    """Write ``bench_save.{md,json}`` under ``out``; return the markdown."""
    os.makedirs(out, exist_ok=True)
    rows = all_rows(worlds)
    text = markdown(rows, worlds, config)
    with open(os.path.join(out, "bench_save.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "bench_save.json"), "w") as f:
        rows_json = [{**asdict(r), "ours_vs_limit": _finite(r.vs_limit), "ours_vs_peer": _finite(r.vs_peer)}
                     for r in rows]
        json.dump({"config": config, "rows": rows_json, "worlds": {str(w): res for w, res in worlds.items()}},
                  f, indent=1, allow_nan=False)
    return text
