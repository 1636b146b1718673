"""Turn a run's results into the JSON document, the markdown report and the PNG plot.

Ratios are taken per repetition between measurements made back to back (the same
repetition of the same block size), then summarised as median [min-max]; the headline
kvstore configuration is the default one (``engine="auto"`` picks io_uring here, raw
codec).  Targets are the design brief's (``DESIGN.md``, "Performance targets").
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks import report_concurrency
from benchmarks.common import human
from benchmarks.report_concurrency import target_row

HEADLINE = "kvstore io_uring raw"
FIO = "fio"
PEERS = ("lmcache", "file-per-block", "torch.save", "numpy")


def _by(samples: Sequence[dict[str, Any]], system: str, op: str, block: int
        ) -> dict[int, dict[str, Any]]:
    return {s["rep"]: s for s in samples
            if (s["system"], s["op"], s["block_bytes"]) == (system, op, block)}


def ratios(samples: Sequence[dict[str, Any]], a: str, b: str, op: str, block: int
           ) -> list[float]:
    x, y = _by(samples, a, op, block), _by(samples, b, op, block)
    return [x[r]["MB_s"] / y[r]["MB_s"] for r in sorted(x) if r in y]


def _med(vals: Sequence[float]) -> float | None:
    return statistics.median(vals) if vals else None


def summarise(samples: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = sorted({(s["system"], s["op"], s["block_bytes"]) for s in samples})
    rows = []
    for system, op, block in keys:
        got = list(_by(samples, system, op, block).values())
        mb = [s["MB_s"] for s in got]
        rows.append({"system": system, "op": op, "block_bytes": block, "reps": len(got),
                     "MB_s": {"min": min(mb), "median": statistics.median(mb), "max": max(mb)},
                     "blocks_s_median": statistics.median(s["blocks_s"] for s in got)})
    return rows


def _fmt_ratio(vals: Sequence[float]) -> str:
    if not vals:
        return "n/a"
    med = statistics.median(vals)
    return f"**{med:.2f}** [{min(vals):.2f}-{max(vals):.2f}]" if len(vals) > 1 else \
        f"**{med:.2f}**"


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every design target with its measured value and whether it is met (None: not
    measured in this run)."""
    s = doc["samples"]
    blocks = doc["config"]["block_sizes"]
    head = doc.get("headline", HEADLINE)
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, goal: float, unit: str = "x",
            less: bool = False, detail: str = "") -> None:
        out.append(target_row(name, value, goal, unit=unit, less=less, detail=detail))

    for op in ("put", "get"):
        for b in blocks:
            if b >= (1 << 20):
                add(f"{op} {human(b)} >= 0.9x fio", _med(ratios(s, head, FIO, op, b)), 0.9)
        if 64 << 10 in blocks:
            add(f"{op} 64 KiB >= 0.7x fio IOPS", _med(ratios(s, head, FIO, op, 64 << 10)),
                0.7)
    big = {r["system"]: r for r in doc.get("beyond_dirty_limit", [])}
    if head in big and "lmcache" in big:
        add("store 2 MiB >= 2x LMCache (beyond the dirty limit)",
            big[head]["MB_s"] / big["lmcache"]["MB_s"], 2.0,
            detail=f"{big[head]['bytes'] / 2**30:.1f} GiB each, one run")
    for b, goal in ((2 << 20, 2.0), (32 << 20, 1.0)):
        if b in blocks:
            add(f"store {human(b)} >= {goal:g}x LMCache",
                _med(ratios(s, head, "lmcache", "put", b)), goal)
    for b, goal in ((1 << 20, 1.2), (64 << 10, 3.0)):
        if b in blocks:
            add(f"store {human(b)} >= {goal:g}x file-per-block",
                _med(ratios(s, head, "file-per-block", "put", b)), goal)
    for peer in PEERS:
        worst = [(_med(ratios(s, head, peer, "get", b)), b) for b in blocks]
        worst = [(v, b) for v, b in worst if v is not None]
        if worst:
            v, b = min(worst)
            add(f"cold get >= {peer} (every block size)", v, 1.0, detail=f"worst at {human(b)}")
    scale = doc.get("scale") or []
    if scale:
        top = max(scale, key=lambda r: r["blocks"])
        add(f"open() of {top['blocks']:,} blocks < 1 s (fresh process, cold cache)",
            top["open_cold_s"], 1.0, unit="s", less=True)
        chains = [r for r in scale if r["chain"] >= 8192]
        if chains:
            worst_mp = max(r["match_prefix_ms"]["median"] for r in chains)
            add("match_prefix over 8,192 blocks < 5 ms (worst store size)", worst_mp, 5.0,
                unit="ms", less=True)
    for op in ("put", "get"):
        fp8 = [(v, b) for b in blocks if (v := _med(ratios(s, head.replace(" raw", " fp8"),
                                                           head, op, b))) is not None]
        if fp8:
            add(f"FP8 {op} > raw (input bytes/s; median over block sizes)",
                statistics.median(v for v, _ in fp8), 1.0)
        from_1mib = [(v, b) for v, b in fp8 if b >= 1 << 20]
        if from_1mib:  # the target's form: at every size of 1 MiB and more
            v, b = min(from_1mib)
            add(f"FP8 {op} >= raw at every block size >= 1 MiB (input bytes/s)", v, 1.0,
                detail=f"worst at {human(b)}")
    return [t for t in out if t["met"] is not None] + report_concurrency.targets(doc)


def _fmt_target_value(t: dict[str, Any]) -> str:
    v = t["value"]
    if v is None:
        return "n/a"
    return f"{v:.2f}{'' if t['unit'] == 'x' else ' ' + t['unit']}"


def _target_rows(doc: dict[str, Any]) -> list[str]:
    md = ["| target | measured | met |", "|---|---:|:---:|"]
    for t in doc["targets"]:
        met = "reported" if t.get("reported") else \
            {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        detail = f" ({t['detail']})" if t["detail"] else ""
        md.append(f"| {t['target']}{detail} | {_fmt_target_value(t)} | {met} |")
    return md


def markdown(doc: dict[str, Any]) -> str:
    m, cfg = doc["machine"], doc["config"]
    s = doc["samples"]
    blocks = cfg["block_sizes"]
    systems = [x for x in doc["system_order"] if any(r["system"] == x for r in s)]
    head = doc.get("headline", HEADLINE)
    md: list[str] = ["# kvstore vs the physical limit and the peers\n"]
    md.append(f"Command: `{doc['command']}`  \n"
              f"{m['timestamp_utc']}, {doc['total_seconds']:.0f} s, mode: {cfg['mode']}\n")
    md.append(f"- machine: {m['nproc']} CPUs ({m['cpu']}), {m['mem_gib']} GiB RAM, kernel "
              f"{m['kernel']}, Python {m['python']}, torch {m['torch']} "
              f"({m['torch_threads']} threads), kvstore "
              f"{m['kvstore']} ({m['kvstore_source']}), {m.get('fio') or 'fio: not found'}")
    md.append(f"- file system: `{m['dir']}` on **{m['fs_type']}** ({m['fs_device']}, I/O "
              f"scheduler {m['io_scheduler']}); dirty page limit "
              f"{m['dirty_thresholds']['dirty'] / 2**30:.1f} GiB (background "
              f"{m['dirty_thresholds']['background'] / 2**30:.1f} GiB)")
    md.append(f"- load average (1/5/15 min) at start {m['loadavg_start']}, at end "
              f"{m['loadavg_end']}; CPU used by other processes while measuring: median "
              f"{doc['other_cpu_pct']['median']:.0f}% of one CPU, max "
              f"{doc['other_cpu_pct']['max']:.0f}% (includes kernel I/O threads and the "
              "LMCache driver process)")
    md.append(f"- per measurement ~{cfg['volume_bytes'] / 2**20:.0f} MiB of bf16 KV blocks "
              f"(`[2, layers, 16, 8, 128]`, same bytes for every system), {cfg['reps']} "
              "repetitions interleaved (system order rotates); MB/s = 10^6 input bytes/s, "
              "min / **median** / max; ratios per repetition, **median** [min-max]")
    md.append(f"- stores are timed until durable: kvstore `sync=True` (fdatasync + LMDB "
              f"commit), fio `--end_fsync=1`, peers + one `syncfs`; reads are cold: "
              f"{cfg['cold']}")
    md.append(f"- fio: io_uring, O_DIRECT, iodepth {cfg['iodepth']} (kvstore's queue_depth), "
              f"bs = block size (`fio buffered`: the same read through the page cache, a "
              f"reference for what readahead gives buffered readers on this disk); kvstore: "
              f"extent_bytes {human(cfg['extent_bytes'])}, "
              f"staging_bytes {human(cfg['staging_bytes'])}"
              f"{' (defaults)' if cfg['mode'] == 'full' else ' (small: smoke run)'}")
    for note in doc["skipped"]:
        md.append(f"- **skipped**: {note}")
    md.append("")

    md.append("## Targets\n")
    md += _target_rows(doc)
    md.append("")

    for op, title in (("put", "Store (durable), MB/s"), ("get", "Cold get, MB/s")) if s else ():
        md.append(f"## {title}\n")
        md.append("| system | " + " | ".join(human(b) for b in blocks) + " |")
        md.append("|---|" + "---:|" * len(blocks))
        for x in [x for x in systems if any((r["system"], r["op"]) == (x, op) for r in s)]:
            cells = []
            for b in blocks:
                vals = [r["MB_s"] for r in _by(s, x, op, b).values()]
                cells.append(f"{min(vals):.0f} / **{statistics.median(vals):.0f}** / "
                             f"{max(vals):.0f}" if vals else "n/a")
            md.append(f"| {x} | " + " | ".join(cells) + " |")
        md.append("")
        md.append(f"Ratios, {head} / other (per repetition):\n")
        md.append("| other | " + " | ".join(human(b) for b in blocks) + " |")
        md.append("|---|" + "---:|" * len(blocks))
        for x in systems:
            if x == head or not any((r["system"], r["op"]) == (x, op) for r in s):
                continue
            md.append(f"| {x} | " + " | ".join(_fmt_ratio(ratios(s, head, x, op, b))
                                               for b in blocks) + " |")
        md.append("")

    if doc.get("beyond_dirty_limit"):
        big = doc["beyond_dirty_limit"]
        ref = {r["system"]: r for r in big}
        md.append("## Store beyond the dirty limit\n")
        md.append(f"One durable store of {big[0]['bytes'] / 2**30:.1f} GiB "
                  f"({big[0]['blocks']} blocks of {human(big[0]['block_bytes'])}) per "
                  "system, more than the kernel's dirty limit, so peers' writes are "
                  "throttled and written back while they run.\n")
        md.append(f"| system | MB/s | {head} / system |")
        md.append("|---|---:|---:|")
        for r in big:
            rel = ref[head]["MB_s"] / r["MB_s"] if head in ref else None
            md.append(f"| {r['system']} | {r['MB_s']:.0f} | "
                      f"{'n/a' if rel is None else f'{rel:.2f}'} |")
        md.append("")

    if doc.get("latency"):
        lat = doc["latency"]
        md.append(f"## Latency per batch ({lat[0]['batch']} blocks of "
                  f"{human(lat[0]['block_bytes'])}, {lat[0]['batches']} batches)\n")
        md.append("Store durable per batch; gets cold (after a restart and an emptied page "
                  "cache). p99 is nearest-rank: with fewer than 100 batches it is the max.\n")
        md.append("| system | op | p50 ms | p99 ms | max ms | MB/s at p50 |")
        md.append("|---|---|---:|---:|---:|---:|")
        for r in sorted(lat, key=lambda r: (r["op"] != "put", r["system"])):
            md.append(f"| {r['system']} | {r['op']} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | "
                      f"{r['max_ms']:.0f} | {r['MB_s_median']:.0f} |")
        md.append("")

    md += report_concurrency.markdown(doc)

    if doc.get("scale"):
        md.append("## Scale: open() and match_prefix vs stored blocks\n")
        md.append("A fresh process per size (an engine restart): first `open()` with the "
                  "page cache emptied (includes kvstore's lazy imports and the I/O engine "
                  "probe), a second `open()`, then `match_prefix` over an 8,192-block chain "
                  "(all present; smaller stores: the whole store), median of 20; resident "
                  "memory of that process.\n")
        if doc.get("scale_from"):
            sf = doc["scale_from"]
            md.append(f"These rows come from an earlier run on this machine "
                      f"({sf['timestamp_utc']}, load average {sf['loadavg'][0]} at start, "
                      f"{sf['loadavg'][1]} at end): `{sf['command']}`.\n")
        md.append("| blocks | build s | open() first ms | open() again ms | match_prefix ms "
                  "(chain) | RSS before open MiB | + after open MiB | + after lookups MiB "
                  "| store on disk MiB |")
        md.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in doc["scale"]:
            md.append(
                f"| {r['blocks']:,} | {r['build_s']:.1f} | {r['open_cold_s'] * 1e3:.0f} | "
                f"{r['open_warm_s'] * 1e3:.1f} | {r['match_prefix_ms']['median']:.2f} "
                f"({r['chain']:,}) | {r['rss_before_open'] / 2**20:.0f} | "
                f"{(r['rss_after_open'] - r['rss_before_open']) / 2**20:.1f} | "
                f"{(r['rss_after_match'] - r['rss_before_open']) / 2**20:.1f} | "
                f"{r['disk_bytes'] / 2**20:.0f} |")
        md.append("")

    if doc.get("systems"):
        md.append("## Systems\n")
        for d in doc["systems"]:
            extra = {k: v for k, v in d.items() if k not in ("name", "family")}
            md.append(f"- `{d['name']}`: {extra}")
        md.append("")
    if doc["notes"]:
        md.append("## Notes\n")
        md.extend(f"- {n}" for n in doc["notes"])
        md.append("")
    if doc.get("plot"):
        md.append(f"![throughput vs block size]({os.path.basename(doc['plot'])})\n")
    return "\n".join(md)


def plot(doc: dict[str, Any], path: str) -> str | None:
    """Throughput vs block size, one line per system; None (and a note) without
    matplotlib (``pip install -e '.[bench]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        doc["skipped"].append("plot: matplotlib is not installed (pip install -e '.[bench]')")
        return None
    s = doc["samples"]
    if not s:
        return None
    blocks = doc["config"]["block_sizes"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=False)
    colors = [plt.get_cmap("tab10")(i) for i in range(10)]
    color = {x: colors[i % len(colors)] for i, x in enumerate(doc["system_order"])}
    for ax, op, title in zip(axes, ("put", "get"), ("store, durable", "cold get")):
        for x in doc["system_order"]:
            pts = [(b, statistics.median(r["MB_s"] for r in got.values()))
                   for b in blocks if (got := _by(s, x, op, b))]
            if pts:  # one color per system in both panels, whichever it lacks
                style = "-" if x.startswith("kvstore") else ("--" if x.startswith(FIO) else ":")
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=x,
                        color=color[x])
        ax.set_xscale("log", base=2)
        ax.set_xticks(blocks, [human(b) for b in blocks])
        ax.set_xlabel("block size")
        ax.set_ylabel("MB/s (input bytes, median)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    handles = {h.get_label(): h for ax in axes for h in ax.get_lines()}
    axes[1].legend(list(handles.values()), list(handles), fontsize=8, loc="upper left")
    fig.suptitle(f"kvstore vs fio and peers ({doc['machine']['timestamp_utc']}, "
                 f"{doc['machine']['fs_type']}, load {doc['machine']['loadavg_start']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def compact(doc: dict[str, Any]) -> str:
    """A short form for the README: targets, then median MB/s per block size."""
    s = doc["samples"]
    blocks = doc["config"]["block_sizes"]
    systems = [x for x in doc["system_order"] if any(r["system"] == x for r in s)]
    md = _target_rows(doc)
    md.append("")
    md.append("| op | block | " + " | ".join(systems) + " |")
    md.append("|---|---|" + "---:|" * len(systems))
    for op in ("put", "get"):
        for b in blocks:
            cells = []
            for x in systems:
                vals = [r["MB_s"] for r in _by(s, x, op, b).values()]
                cells.append(f"{statistics.median(vals):.0f}" if vals else "n/a")
            md.append(f"| {op} | {human(b)} | " + " | ".join(cells) + " |")
    return "\n".join(md) + "\n"
