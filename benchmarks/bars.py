"""The issues' bars over benchmarks/attention.py rows, checked where the run measured them.

No torch here: benchmarks/attention.py prints the checks after a run and benchmarks/report.py
computes them from the rows of any results file (they are not stored: a file written before a
bar existed is read against it too). A check is made only for rows whose peer provider ran (a
provider left out of a run is not a failure); a peer that ran and errored gives ``got`` None and
fails.

* issue 15 (Hopper attention): dense d64 and d128, causal and not, S = 4K-32K: the forward and
  the forward+backward >= 1.0x SDPA with no backend forced (``sdpa``).
* issue 2 (the first Triton kernels): d128 causal, S >= 2K: forward >= 1.15x SDPA's flash
  backend and >= FlexAttention, forward+backward >= 1.0x SDPA's flash backend; a window of 4096
  at S = 32K >= 3x hf_flash's own causal time.
"""

from __future__ import annotations

ISSUE_15_SEQLENS = (4096, 8192, 16384, 32768)


def _check(bar: str, name: str, need: float, got) -> dict:
    return {"bar": bar, "check": name, "need": need, "got": got, "ok": got is not None and got >= need}


def causal_twin(r: dict, rows: list[dict]):
    """The causal row of ``r``'s point (head dim, seqlen, pass, batch) from the same run (merged
    files hold rows of several runs), or None."""
    for c in rows:
        if c["mask"] == "causal" and c.get("run") == r.get("run") and all(
            c.get(f) == r.get(f) for f in ("head_dim", "seqlen", "pass", "batch")
        ):
            return c
    return None


def _speedup(causal: dict, window: dict):
    c_ms = (causal.get("results") or {}).get("hf_flash", {}).get("ms")
    w_ms = (window.get("results") or {}).get("hf_flash", {}).get("ms")
    return c_ms / w_ms if c_ms and w_ms else None


def window_speedup(r: dict, rows: list[dict]):
    """hf_flash's causal time over its time with the window of row ``r``, both from one run;
    None where the rows cannot say."""
    c = causal_twin(r, rows)
    return None if c is None else _speedup(c, r)


def bar_checks(rows: list[dict]) -> list[dict]:
    """The checks of both bars that ``rows`` can answer, issue 15's first."""
    issue15, issue2 = [], []
    for r in rows:
        ran = r.get("results") or {}
        ratio = r.get("ratio") or {}
        point = f"D{r['head_dim']} {r['mask']} S={r['seqlen']} {r['pass']}"
        if (r["head_dim"] in (64, 128) and r["mask"] in ("causal", "full")
                and r["seqlen"] in ISSUE_15_SEQLENS and r["pass"] in ("fwd", "fwd+bwd")
                and "sdpa" in ran):  # fmt: skip
            issue15.append(_check("issue 15", f"{point} vs sdpa", 1.0, ratio.get("sdpa")))
        if r["head_dim"] == 128 and r["mask"] == "causal" and r["seqlen"] >= 2048:
            want = {"fwd": [("sdpa_flash", 1.15), ("flex", 1.0)], "fwd+bwd": [("sdpa_flash", 1.0)]}
            for peer, need in want.get(r["pass"], []):
                if peer in ran:
                    issue2.append(_check("issue 2", f"{point} vs {peer}", need, ratio.get(peer)))
        if r["mask"] == "window" and r["seqlen"] == 32768 and r["pass"] in ("fwd", "fwd+bwd"):
            twin = causal_twin(r, rows)
            if twin is not None and "hf_flash" in ran:
                issue2.append(_check("issue 2", f"{point} vs own causal", 3.0, _speedup(twin, r)))
    return issue15 + issue2


def by_bar(checks: list[dict]):
    """(bar, heading with the count met, its checks) per bar, in the order of ``checks``."""
    for bar in dict.fromkeys(c["bar"] for c in checks):
        mine = [c for c in checks if c["bar"] == bar]
        yield bar, f"{sum(c['ok'] for c in mine)} of {len(mine)} checks met", mine


def summary_lines(checks: list[dict]) -> list[str]:
    """Per bar: a heading line with the count met, then one line per check (console)."""
    out = []
    for bar, met, mine in by_bar(checks):
        out.append(f"{bar} bar: {met}")
        for c in mine:
            got = "-" if c["got"] is None else f"{c['got']:.2f}"
            out.append(f"  {'PASS' if c['ok'] else 'FAIL'}  {c['check']}: {got} (need >= {c['need']})")
    return out
