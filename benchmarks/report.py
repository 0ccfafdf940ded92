"""Rewrite BENCHMARKS.md from the JSON result files the benchmark scripts write.

    python benchmarks/report.py                       # benchmarks/results/*.json -> BENCHMARKS.md
    python benchmarks/report.py --results OUT --md OUT/BENCHMARKS.md

One section per result file (``{"benchmark", "env", "meta", "rows"}``, see harness.py), each with
the GPU and library versions it was measured with. The attention benchmark gets its own tables
(TFLOP/s per provider, hf_flash's ratio to SDPA-flash and to SDPA's default, the issues' bars
from benchmarks/bars.py);
any other benchmark is shown as a generic table of its rows, whatever fields they have.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: benchmarks/ is the importable package's folder
    sys.path.insert(0, str(ROOT))
from benchmarks.bars import bar_checks, by_bar, window_speedup  # noqa: E402  (after the path is set)

ORDER = ["attention", "attention_configs", "decode", "decode_sweep", "rope", "e2e_generate",
         "e2e_train", "e2e_finetune"]  # fmt: skip
PROVIDERS = ["hf_flash", "sdpa", "sdpa_flash", "sdpa_cudnn", "flex"]
PROVIDER_TITLES = {"hf_flash": "hf_flash", "sdpa": "SDPA default", "sdpa_flash": "SDPA flash",
                   "sdpa_cudnn": "SDPA cuDNN", "flex": "FlexAttention"}  # fmt: skip


def fmt(x) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if x != x:
            return "nan"
        if x == 0:
            return "0"
        if abs(x) >= 100:
            return f"{x:.0f}"
        if abs(x) >= 0.01:
            return f"{x:.3g}"
        return f"{x:.2e}"
    if isinstance(x, (list, tuple)):
        return ", ".join(fmt(v) for v in x)
    if isinstance(x, dict):
        return ", ".join(f"{k}={fmt(v)}" for k, v in x.items())
    return str(x).replace("|", "\\|").replace("\n", " ")


def md_table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return out


def env_line(env: dict) -> str:
    parts = [env.get("gpu") or "no GPU"]
    for key in ("torch", "triton", "transformers", "accelerate", "peft", "cuda", "python"):
        if env.get(key):
            parts.append(f"{key} {env[key]}")
    if env.get("date"):
        parts.append(f"measured {env['date']}")
    return ", ".join(parts)


def meta_line(meta: dict) -> str:
    items = [f"{k}={fmt(v)}" for k, v in meta.items() if not isinstance(v, (dict, list))]
    return "; ".join(items)


# --------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------


def _shape(r: dict) -> str:
    mask = r.get("mask")
    if mask == "window":
        mask = f"window {r.get('window')}"
    return f"D={r.get('head_dim')} {mask} S={r.get('seqlen')} B={r.get('batch')}"


def _provider_cell(r: dict, name: str) -> str:
    res = (r.get("results") or {}).get(name)
    if res is None:
        return "–"
    if "tflops" in res:
        cell = f"{res['tflops']:.0f}"
        if res.get("gqa") == "expanded":
            cell += "ᵉ"
        if res.get("derived"):
            cell += "ᵈ"
        return cell
    return "n/a" if "unsupported" in res else "err"


def attention_section(data: dict) -> list[str]:
    rows = data.get("rows", [])
    present = [p for p in PROVIDERS if any(p in (r.get("results") or {}) for r in rows)]
    out = []
    passes = list(dict.fromkeys(r.get("pass") for r in rows))
    for p in passes:
        sub = [r for r in rows if r.get("pass") == p]
        header = ["shape"] + [PROVIDER_TITLES[x] for x in present]
        header += ["hf / SDPA flash", "hf / SDPA default", "hf / FlexAttention", "max diff vs SDPA"]
        # rows of runs since 2026-11-30 also hold the median of each round's own ratio
        paired = any((r.get("ratio_paired") or {}).get("sdpa") is not None for r in sub)
        if paired:
            header.insert(-1, "hf / SDPA default, paired rounds")
        windowed = any(r.get("mask") == "window" for r in sub)
        if windowed:
            header.append("window speedup vs causal")
        body = []
        for r in sub:
            ratio = r.get("ratio") or {}
            line = [_shape(r)] + [_provider_cell(r, x) for x in present]
            line += [ratio.get("sdpa_flash"), ratio.get("sdpa"), ratio.get("flex")]
            if paired:
                line.append((r.get("ratio_paired") or {}).get("sdpa"))
            line.append(r.get("max_abs_diff_vs_sdpa"))
            if windowed:
                line.append(window_speedup(r, rows) if r.get("mask") == "window" else None)
            body.append(line)
        out += [f"#### {p} (TFLOP/s)", ""] + md_table(header, body) + [""]
    out.append(
        "ᵉ K/V expanded to Hq heads outside the timed region (that SDPA backend refused "
        "`enable_gqa`, or SDPA's masked path as transformers runs it); ᵈ backward derived as "
        "(fwd+bwd − fwd); n/a: the provider has no such mode; err: see the error list. FLOPs are "
        "counted identically for every provider."
    )
    out.append("")
    errors: dict[tuple[str, str], int] = {}
    for r in rows:
        for name, res in (r.get("results") or {}).items():
            if "error" in res:
                errors[(name, res["error"])] = errors.get((name, res["error"]), 0) + 1
    if errors:
        out += ["Errors:", ""]
        out += [f"- {name} ({n} rows): `{err}`" for (name, err), n in errors.items()]
        out.append("")
    # the bars as benchmarks/bars.py defines them, over this file's rows (checks whose peer did
    # not run are left out)
    for bar, met, mine in by_bar(bar_checks(rows)):
        out += [f"Bar of {bar}: {met}", ""]
        out += [f"- {'PASS' if c['ok'] else 'FAIL'} {c['check']}: {fmt(c['got'])} (need ≥ {c['need']})"
                for c in mine]  # fmt: skip
        out.append("")
    return out


def attention_configs_section(data: dict) -> list[str]:
    rows = data.get("rows", [])
    header = ["D", "S", "kernel", "BLOCK_M×BLOCK_N, warps, stages", "fwd ms", "fwd TFLOP/s", "bwd ms",
              "bwd TFLOP/s", "override reached launcher", "error"]  # fmt: skip
    body = []
    for r in rows:
        c = r.get("config")
        cfg = (f"{c['BLOCK_M']}×{c['BLOCK_N']}, {c['num_warps']}, {c['num_stages']}"
               if isinstance(c, dict) else "default")  # fmt: skip
        body.append([r.get("head_dim"), r.get("seqlen"), r.get("kernel"), cfg, r.get("fwd_ms"), r.get("fwd_tflops"),
                     r.get("bwd_ms"), r.get("bwd_tflops"), r.get("override_reached_launcher"),
                     r.get("error")])  # fmt: skip
    return md_table(header, body) + [""]


# --------------------------------------------------------------------------------------------
# any other benchmark
# --------------------------------------------------------------------------------------------


def _flatten(row: dict, prefix: str = "") -> dict:
    flat = {}
    for k, v in row.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and not prefix:
            flat.update(_flatten(v, f"{key}."))
        else:
            flat[key] = v
    return flat


def generic_section(data: dict) -> list[str]:
    rows = [_flatten(r) if isinstance(r, dict) else {"value": r} for r in data.get("rows", [])]
    if not rows:
        return ["(no rows)", ""]
    cols = list(dict.fromkeys(k for r in rows for k in r))
    return md_table(cols, [[r.get(c) for c in cols] for r in rows]) + [""]


SECTIONS = {"attention": attention_section, "attention_configs": attention_configs_section}


def load(paths: list[Path]) -> list[tuple[Path, dict]]:
    found = []
    for base in paths:
        files = sorted(base.glob("*.json")) if base.is_dir() else [base]
        for f in files:
            try:
                data = json.loads(f.read_text())
            except (OSError, ValueError) as e:
                print(f"report: skipping {f}: {e}", file=sys.stderr)
                continue
            if isinstance(data, dict) and "rows" in data:
                found.append((f, data))
    rank = {name: i for i, name in enumerate(ORDER)}
    found.sort(key=lambda x: (rank.get(x[1].get("benchmark"), len(ORDER)),
                              str(x[1].get("benchmark")), x[0].name))  # fmt: skip
    return found


def render(found: list[tuple[Path, dict]]) -> str:
    out = [
        "# Benchmarks",
        "",
        "Generated by `benchmarks/report.py` from the JSON files in `benchmarks/results/` "
        "(written by `scripts/gpu_suite.sh OUTDIR` on the GPU); do not edit by hand.",
        "",
    ]
    gpus = sorted({fmt(d.get("env", {}).get("gpu")) for _, d in found})
    if gpus:
        out += [f"GPUs: {', '.join(gpus)}.", ""]
    for path, data in found:
        name = data.get("benchmark") or path.stem
        out += [f"## {name}", "", f"`{path.name}` — {env_line(data.get('env') or {})}.", ""]
        meta = meta_line(data.get("meta") or {})
        if meta:
            out += [f"Conditions: {meta}.", ""]
        try:
            out += SECTIONS.get(name, generic_section)(data)
        except Exception as e:  # a malformed file must not hide the others
            out += [f"(could not render with the {name} layout: {type(e).__name__}: {e})", ""]
            out += generic_section(data)
    notes = Path(__file__).parent / "notes.md"
    if notes.is_file():  # hand-written conditions and history, kept beside the generated tables
        out += ["## Measurement notes", "", f"From `benchmarks/{notes.name}` (hand-written).", ""]
        out += notes.read_text().split("\n")[1:]
    return "\n".join(out).rstrip() + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, nargs="+", default=[ROOT / "benchmarks" / "results"],
                   help="folders (or files) holding result JSON")  # fmt: skip
    p.add_argument("--md", type=Path, default=ROOT / "BENCHMARKS.md", help="file to (re)write")
    args = p.parse_args(argv)
    found = load(args.results)
    args.md.parent.mkdir(parents=True, exist_ok=True)
    args.md.write_text(render(found))
    print(f"report: {len(found)} result files -> {args.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
