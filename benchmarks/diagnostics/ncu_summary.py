"""Read Nsight Compute text exports side by side: raw metrics and per-instruction stall samples.

    python benchmarks/diagnostics/ncu_summary.py raw REGEX A.raw.csv [B.raw.csv ...]
    python benchmarks/diagnostics/ncu_summary.py stalls A.source.csv [--top 25]

``raw``: the metrics whose name matches REGEX, one column per report (``ncu -i R --page raw
--csv``). ``stalls``: from a source page (``ncu -i R --page source --csv --print-source sass``,
a SourceCounters report), the warp-stall reasons over all samples, the opcodes that gather the
most samples with their top reasons, and the instructions with the most samples (address, times
executed, SASS, top reasons): enough to tell which partition of a warp-specialised kernel waits
on what. benchmarks/hopper_bwd_ncu_device_run.sh writes both exports. GPU: no.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re


def _raw(path):
    rows = list(csv.reader(open(path)))
    for i, r in enumerate(rows):
        if r and r[0] == "ID":
            data = rows[i + 2] if rows[i + 1] and rows[i + 1][0] == "" else rows[i + 1]
            return dict(zip(r, data))
    raise ValueError(f"{path}: no raw-page header")


def raw(pattern, paths):
    reports = [_raw(p) for p in paths]
    rx = re.compile(pattern)
    for k in reports[0]:
        if rx.search(k):
            print(f"{k[:90]:90s} " + " | ".join(r.get(k, "-")[:16] for r in reports))


def stalls(path, top):
    rows = list(csv.reader(open(path)))
    hdr = rows[1]
    data = [r for r in rows[2:] if len(r) >= len(hdr)]
    ix = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    samples = [int(r[ix["Warp Stall Sampling (All Samples)"]] or 0) for r in data]
    total = sum(samples) or 1
    by_reason = collections.Counter()
    by_op = collections.defaultdict(collections.Counter)
    for r, s in zip(data, samples):
        src = r[ix["Source"]].strip()
        op = re.sub(r"^@!?U?P\w+\s+", "", src).split(" ")[0]
        op = ".".join(op.split(".")[:2]) if op.startswith(("WARPGROUP", "SYNCS", "HGMMA")) else op.split(".")[0]
        by_op[op]["_all"] += s
        for st in reasons:
            v = int(r[ix[st]] or 0)
            by_reason[st] += v
            by_op[op][st] += v
    print(f"{path}: {total} samples")
    for st, v in by_reason.most_common(12):
        print(f"  {st:24s} {100 * v / total:5.1f}%")
    print("  by opcode:")
    for op, c in sorted(by_op.items(), key=lambda kv: -kv[1]["_all"])[:16]:
        tops = ", ".join(f"{k[6:]} {100 * v / total:.1f}" for k, v in c.most_common(4) if k != "_all")
        print(f"  {op:22s} {100 * c['_all'] / total:5.1f}%  {tops}")
    print("  instructions:")
    for i in sorted(sorted(range(len(data)), key=lambda i: -samples[i])[:top]):
        r = data[i]
        tops = sorted(((int(r[ix[st]] or 0), st[6:]) for st in reasons), reverse=True)[:2]
        print(f"  {i:5d} {r[ix['Address']][-5:]} {100 * samples[i] / total:5.1f}% exec "
              f"{r[ix['Instructions Executed']]:>10s}  {r[ix['Source']].strip()[:70]:70s} {tops}")  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("raw")
    a.add_argument("pattern")
    a.add_argument("paths", nargs="+")
    b = sub.add_parser("stalls")
    b.add_argument("path")
    b.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    if args.cmd == "raw":
        raw(args.pattern, args.paths)
    else:
        stalls(args.path, args.top)


if __name__ == "__main__":
    main()
