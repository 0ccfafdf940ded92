"""Host time per public attention call, an older hf_flash beside the working tree's in one process,
interleaved (diagnostic).

The host of a lent GPU machine changes speed by 30-50% between runs and even inside one, so two
runs cannot compare host-time changes of 10-30%. Here both packages run in the same process in
alternating loops (ABBA and BAAB order in turn), and each round gives a paired ratio new / base; the
median of those ratios is the comparison, SDPA's forward + backward timed the same way is the
noise floor (its ratio should read 1.0).

    python benchmarks/diagnostics/host_ab.py --prepare REV DIR    # here: REV's hf_flash as DIR/hf_flash_base
    PYTHONPATH=. python benchmarks/diagnostics/host_ab.py --base DIR [--seqlen 512] [--head-dim 128]

``--prepare`` copies ``hf_flash`` at git revision REV and renames it ``hf_flash_base`` (its
imports, and its torch.library op namespace, so both packages' custom ops can be registered).
Each loop: ``--calls`` calls (B=1, Hq=32, Hkv=8, bf16, causal), the time until everything is
queued divided by the calls (the device is synchronised outside the timing). ``--cpus 1`` puts
every thread on one core: with it, the rows "forward + backward" (the backward on autograd's
device thread) and "calling thread" show whether that thread's extra cost comes from running on
another core.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

BASE = "hf_flash_base"


def prepare(rev: str, dest: Path) -> None:
    """``git archive`` of ``rev``'s hf_flash into ``dest/hf_flash_base``, renamed."""
    root = Path(__file__).resolve().parents[2]
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tar = Path(tmp) / "base.tar"
        subprocess.run(["git", "-C", str(root), "archive", "-o", str(tar), rev, "hf_flash"], check=True)
        with tarfile.open(tar) as t:
            t.extractall(tmp, filter="data")
        target = dest / BASE
        if target.exists():
            raise SystemExit(f"{target} exists; remove it first")
        (Path(tmp) / "hf_flash").rename(target)
    renames = [(re.compile(r"\bhf_flash(?=[.:\s]|$)", re.M), BASE)]
    for path in target.rglob("*.py"):
        text = path.read_text()
        for pattern, repl in renames:
            text = pattern.sub(repl, text)
        path.write_text(text)
    print(f"{rev} -> {target}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", nargs=2, metavar=("REV", "DIR"))
    parser.add_argument("--base", type=Path, help="the directory holding hf_flash_base")
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--cpus", type=int, default=0,
                        help="run on the first N CPUs only (threads made later, autograd's device threads "
                             "included, inherit it; 1: every thread on one core)")  # fmt: skip
    args = parser.parse_args()
    if args.cpus:
        import os

        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:args.cpus]))
    if args.prepare:
        prepare(args.prepare[0], Path(args.prepare[1]))
        return
    if args.base is None:
        parser.error("--base DIR (or --prepare REV DIR)")
    sys.path.insert(0, str(args.base.resolve()))
    import torch
    import torch.nn.functional as F

    import hf_flash
    import hf_flash_base

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from benchmarks.diagnostics.attention_host_time import call_tensors

    s, d = args.seqlen, args.head_dim
    q, k, v, qg, kg, vg, dout = call_tensors(s, d)
    qh, kh, vh = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    douth = dout.transpose(1, 2).contiguous()

    def rows(fn):
        def fwd():
            with torch.no_grad():
                fn(q, k, v, causal=True)

        def fwd_grad():
            fn(qg, kg, vg, causal=True)

        def fwd_bwd():
            torch.autograd.grad(fn(qg, kg, vg, causal=True), (qg, kg, vg), dout)

        def fwd_bwd_here():  # the backward on the calling thread, not autograd's device thread
            with torch.autograd.set_multithreading_enabled(False):
                fwd_bwd()

        return {"forward (no grad)": fwd, "forward (grad enabled)": fwd_grad, "forward + backward": fwd_bwd,
                "forward + backward, calling thread": fwd_bwd_here}

    def sdpa():
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        torch.autograd.grad(o, (qh, kh, vh), douth)

    new, base = rows(hf_flash.flash_attn_func), rows(hf_flash_base.flash_attn_func)
    pairs = [(label, base[label], new[label]) for label in new]
    pairs.append(("SDPA forward + backward (noise floor)", sdpa, sdpa))

    def loop(fn) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        elapsed = time.perf_counter() - t0
        return elapsed / args.calls * 1e6

    for _, a, b in pairs:  # warm-up: compile, caches
        for _ in range(3):
            loop(a), loop(b)
    times = {label: ([], []) for label, _, _ in pairs}
    for r in range(args.rounds):
        for label, a, b in pairs:
            # ABBA on even rounds, BAAB on odd ones: the first loop after another row's (colder
            # caches) falls on each package equally often
            if r % 2 == 0:
                ta1, tb1, tb2, ta2 = loop(a), loop(b), loop(b), loop(a)
            else:
                tb1, ta1, ta2, tb2 = loop(b), loop(a), loop(a), loop(b)
            times[label][0].append((ta1 + ta2) / 2)
            times[label][1].append((tb1 + tb2) / 2)
    torch.cuda.synchronize()
    print(f"Host us per call, B=1 S={s} Hq=32 Hkv=8 d={d} causal bf16, {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}; {args.rounds} rounds of ABBA / BAAB loops of {args.calls} calls")  # fmt: skip
    print(f"{'':40} {'base med':>9} {'new med':>9} {'base min':>9} {'new min':>9} {'new/base':>9} {'q1-q3':>12}")
    for label, (ta, tb) in times.items():
        ratios = sorted(b / a for a, b in zip(ta, tb))
        q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
        print(f"{label:40} {statistics.median(ta):9.1f} {statistics.median(tb):9.1f} {min(ta):9.1f} {min(tb):9.1f} "
              f"{statistics.median(ratios):9.3f} {q1:6.3f}-{q3:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
