"""The report of :mod:`benchmarks.callers` and :mod:`benchmarks.mixed`: summary rows,
targets (from the design brief) and the markdown sections.

Ratios are kvstore / fio per repetition (measured back to back), summarised as median
[min-max], like the sweep's.  CPU cost is median core-seconds per GB moved.  Targets
with no threshold (CPU cost, memory) are "reported": ``met`` is True once measured and
``reported`` says so.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.common import human, summary

KVSTORE, FIO = "kvstore", "fio"
BIG = 1 << 20  # the >= 0.9x fio targets are for blocks of 1 MiB and more
SMALL = 64 << 10  # the IOPS target's block size
Row = dict[str, Any]


def target_row(name: str, value: float | None, goal: float | None, unit: str = "x",
               less: bool = False, strict: bool = True, detail: str = "",
               reported: bool = False) -> Row:
    """One row of the targets table; ``met`` None when not measured.  ``less``: the value
    must stay below ``goal`` (``strict``: ``<``, else ``<=``); ``reported``: no threshold,
    met once measured."""
    if value is None:
        met = None
    elif reported or goal is None:
        met = True
    elif less:
        met = value < goal if strict else value <= goal
    else:
        met = value >= goal
    return {"target": name, "value": value, "goal": goal, "unit": unit,
            "less_is_better": less, "met": met, "detail": detail, "reported": reported}


def _by_rep(samples: Sequence[Row], system: str, callers: int, op: str, block: int
            ) -> dict[int, Row]:
    return {s["rep"]: s for s in samples if (s["system"], s["callers"], s["op"],
                                             s["block_bytes"]) == (system, callers, op, block)}


def ratios(samples: Sequence[Row], callers: int, op: str, block: int) -> list[float]:
    """kvstore / fio throughput, per repetition."""
    kv, fio = (_by_rep(samples, x, callers, op, block) for x in (KVSTORE, FIO))
    return [kv[r]["MB_s"] / fio[r]["MB_s"] for r in sorted(kv) if r in fio]


def _median_of(rows: Sequence[Row], key: str) -> float | None:
    return statistics.median(r[key] for r in rows) if rows else None


def summarise(part: dict[str, Any]) -> list[Row]:
    """One row per (op, block, callers): throughput, ratio, CPU cost, memory."""
    s, cfg = part["samples"], part["config"]
    rows = []
    for op in ("put", "get"):
        for block in cfg["block_sizes"]:
            for callers in cfg["callers"]:
                kv = list(_by_rep(s, KVSTORE, callers, op, block).values())
                fio = list(_by_rep(s, FIO, callers, op, block).values())
                if not kv:
                    continue
                r = ratios(s, callers, op, block)
                rows.append({
                    "op": op, "block_bytes": block, "callers": callers,
                    "batch": kv[0]["batch"],
                    "kvstore_MB_s": summary([x["MB_s"] for x in kv]),
                    "fio_MB_s": summary([x["MB_s"] for x in fio]) if fio else None,
                    "ratio": summary(r) if r else None,
                    "kvstore_cpu_s_per_GB": _median_of(kv, "cpu_s_per_GB"),
                    "fio_cpu_s_per_GB": _median_of(fio, "cpu_s_per_GB"),
                    "rss_growth_max": max(x["rss_peak"] - x["rss_before"] for x in kv),
                    "rss_retained_max": max(x["rss_retained"] for x in kv)})
    return rows


def _who(callers: int) -> str:
    return "1 caller" if callers == 1 else f"{callers} concurrent callers"


def _setup_words(callers: int, batch: int) -> str:
    return f"batches of {batch}; fio {callers} job{'s' * (callers > 1)} x QD {64 // callers}"


def _throughput_targets(rows: Sequence[Row]) -> list[Row]:
    out = []
    for r in rows:
        ratio = r["ratio"]["median"] if r["ratio"] else None
        setup = _setup_words(r["callers"], r["batch"])
        who = _who(r["callers"])
        if r["block_bytes"] >= BIG:
            out.append(target_row(f"{r['op']} {human(r['block_bytes'])} >= 0.9x fio, {who}",
                                  ratio, 0.9, detail=setup))
        elif r["block_bytes"] == SMALL:
            stretch = "n/a" if ratio is None else ("met" if ratio >= 0.7 else "not met")
            out.append(target_row(f"{r['op']} 64 KiB >= 0.5x fio IOPS, {who}", ratio, 0.5,
                                  detail=f"{setup}; stretch 0.7x {stretch}"))
    return out


def _cpu_targets(rows: Sequence[Row]) -> list[Row]:
    out = []
    for op in ("put", "get"):
        big = [r for r in rows if r["op"] == op and r["block_bytes"] >= BIG]
        if not big:
            big = [r for r in rows if r["op"] == op]
        if not big:
            continue
        kv = statistics.median(r["kvstore_cpu_s_per_GB"] for r in big)
        fio = [r["fio_cpu_s_per_GB"] for r in big if r["fio_cpu_s_per_GB"] is not None]
        fio_words = f"fio {statistics.median(fio):.3f}" if fio else "fio not measured"
        sizes = ", ".join(human(b) for b in sorted({r["block_bytes"] for r in big}))
        out.append(target_row(
            f"CPU cost of {op}: kvstore core-seconds per GB (reported)", kv, None,
            unit="core-s/GB", reported=True,
            detail=f"{fio_words}; median over {sizes}, 1 and 4 callers; 64 KiB in the "
                   "callers table"))
    return out


def _memory_target(part: dict[str, Any], rows: Sequence[Row]) -> Row:
    growth = max(r["rss_growth_max"] for r in rows) / 2**20
    retained = max(r["rss_retained_max"] for r in rows) / 2**20
    staging = part["config"]["kvstore"]["staging_bytes"]
    return target_row("memory: largest RSS growth within a kvstore measurement (reported)",
                      growth, None, unit="MiB", reported=True,
                      detail=f"staging arena {human(staging)}; left behind once a store "
                             f"is closed: at most {retained:.1f} MiB")


def targets(doc: dict[str, Any]) -> list[Row]:
    """The design's throughput targets measured in this run (nothing for parts not run)."""
    out: list[Row] = []
    part = doc.get("callers")
    if part and part["summary"]:
        rows = part["summary"]
        out += _throughput_targets(rows) + _cpu_targets(rows) + [_memory_target(part, rows)]
    mixed = doc.get("mixed")
    if mixed:
        out.append(target_row("foreground get p99 under a put stream <= 1.5x idle",
                              mixed["p99_ratio"], 1.5, less=True, strict=False,
                              detail=f"{mixed['title']}; p50 {mixed['p50_ratio']:.2f}x"))
    return [t for t in out if t["met"] is not None]


# --------------------------------------------------------------------------- markdown


def _mbs(x: dict[str, float] | None) -> str:
    return "n/a" if x is None else \
        f"{x['min']:.0f} / **{x['median']:.0f}** / {x['max']:.0f}"


def _ratio(x: dict[str, float] | None) -> str:
    return "n/a" if x is None else \
        f"**{x['median']:.2f}** [{x['min']:.2f}-{x['max']:.2f}]"


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "n/a" if x is None else format(x, fmt)


def callers_markdown(part: dict[str, Any]) -> list[str]:
    cfg = part["config"]
    md = ["## One caller vs 4 concurrent callers, CPU cost, memory\n",
          f"Per measurement ~{cfg['volume_bytes'] / 2**20:.0f} MiB, {cfg['reps']} repetitions "
          "interleaved (order rotates). kvstore: one store (`sync=True`, raw), `put_many` then, "
          "after a restart, cold `get_many(out=)` in batches of up to "
          f"{cfg['batch']} blocks; 4 callers = 4 tasks on one store, each its own chain. "
          "fio: io_uring, O_DIRECT, writes `--end_fsync=1`; 1 caller vs 1 job at QD "
          f"{cfg['fio_total_iodepth']}, 4 callers vs 4 jobs at QD "
          f"{cfg['fio_total_iodepth'] // 4} each (the same {cfg['fio_total_iodepth']} in "
          "flight as kvstore's one ring). At 64 KiB the ratio is the IOPS ratio. CPU: "
          "process user+sys time (kvstore, every thread) or fio's reported usr+sys, "
          "core-seconds per GB moved (median). RSS growth: peak VmRSS during the "
          "measurement minus VmRSS before it (max over repetitions; mostly the staging "
          "arena filling); retained: VmRSS after the store is closed minus before it was "
          "opened (max).\n",
          "| op | block | callers (batch) | kvstore MB/s | fio MB/s | kvstore / fio | "
          "kvstore core-s/GB | fio core-s/GB | RSS growth MiB | retained MiB |",
          "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in part["summary"]:
        md.append(f"| {r['op']} | {human(r['block_bytes'])} | {r['callers']} ({r['batch']}) "
                  f"| {_mbs(r['kvstore_MB_s'])} | {_mbs(r['fio_MB_s'])} | "
                  f"{_ratio(r['ratio'])} | {_num(r['kvstore_cpu_s_per_GB'])} | "
                  f"{_num(r['fio_cpu_s_per_GB'])} | {r['rss_growth_max'] / 2**20:.1f} | "
                  f"{r['rss_retained_max'] / 2**20:.1f} |")
    md.append("")
    return md


def mixed_markdown(m: dict[str, Any]) -> list[str]:
    cfg = m["config"]
    md = [f"## Foreground gets under a background put stream ({m['title']})\n",
          f"{cfg['fg_batches']} foreground `get_many(out=)` batches per phase and repetition "
          f"({cfg['reps']} repetitions, pooled), one after another: idle, then while "
          f"{cfg['writers']} tasks `put_many` fresh blocks continuously. Nearest-rank p99 "
          "(the max below 100 batches).\n",
          "| phase | batches | p50 ms | p99 ms | max ms |", "|---|---:|---:|---:|---:|"]
    for phase in ("idle", "loaded"):
        p = m[phase]
        md.append(f"| {phase} | {p['batches']} | {p['p50_ms']:.1f} | {p['p99_ms']:.1f} | "
                  f"{p['max_ms']:.1f} |")
    bg = [s["bg_MB_s"] for s in m["streams"]]
    throughout = all(s["stream_ran_throughout"] for s in m["streams"])
    stream = "the stream ran throughout" if throughout else \
        "in some repetition the stream hit its byte cap before the foreground finished"
    md += ["", f"Loaded / idle: p50 **{m['p50_ratio']:.2f}x**, p99 **{m['p99_ratio']:.2f}x** "
           "(design target p99 <= 1.5x). Background puts while the foreground read: "
           f"{' / '.join(f'{x:.0f}' for x in bg)} MB/s per repetition; {stream}.\n"]
    return md


def markdown(doc: dict[str, Any]) -> list[str]:
    md: list[str] = []
    if doc.get("callers") and doc["callers"]["summary"]:
        md += callers_markdown(doc["callers"])
    if doc.get("mixed"):
        md += mixed_markdown(doc["mixed"])
    return md
