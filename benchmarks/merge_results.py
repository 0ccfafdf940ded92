"""Fold a partial benchmark run into the committed results file.

    python benchmarks/merge_results.py NEW.json --keys shape seq_len attn keep_attention_outputs \\
        --note "--points ... (recipe without peft's input casts)"

Rows of NEW.json replace, in place, the committed rows with the same values of ``--keys`` (rows
without all the keys, e.g. another part of the benchmark, are matched on the keys they have); the
others are appended. Every row taken from NEW.json gets ``run`` (its date, from the file's env) so a
table built from several runs says which run measured which row; ``meta.runs`` gets ``--note``.
The committed file is ``benchmarks/results/<same name>`` unless ``--into`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def merge(old: dict, new: dict, keys: list[str], note: str) -> dict:
    stamp = new.get("env", {}).get("date", "?")

    def key(row):
        return tuple((k, json.dumps(row.get(k))) for k in keys if k in row)

    incoming = {key(row): {**row, "run": stamp} for row in new["rows"]}
    rows = [incoming.pop(key(r), r) for r in old["rows"]]  # replaced in place, order kept
    rows += list(incoming.values())
    meta = dict(old.get("meta", {}))
    runs = meta.get("runs", "")
    entry = f"{stamp}: {note} ({len(new['rows'])} rows)"
    # a file written whole by a benchmark keeps its runs as a list
    meta["runs"] = [*runs, entry] if isinstance(runs, list) else (runs + "; " if runs else "") + entry
    return {**old, "env": new.get("env", old.get("env")), "meta": meta, "rows": rows}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("new", type=Path)
    ap.add_argument("--keys", nargs="+", required=True, help="fields that identify a row")
    ap.add_argument("--note", required=True, help="what this run was (options, what changed)")
    ap.add_argument("--into", type=Path, default=None)
    args = ap.parse_args(argv)
    into = args.into or RESULTS / args.new.name
    new = json.loads(args.new.read_text())
    merged = merge(json.loads(into.read_text()), new, args.keys, args.note) if into.exists() else new
    into.write_text(json.dumps(merged, indent=1, default=str))
    print(f"{into}: {len(merged['rows'])} rows")


if __name__ == "__main__":
    main()
