"""The instructions of one Gluon attention step, per consumer code path, from the SASS (no GPU needed).

    PYTHONPATH=. python benchmarks/diagnostics/sass_step_mix.py \\
        [--variants ws3x4-pp-s3 bwd:kv2x64-m64-s2-dqwldfpsbrr] [--head-dims 64 128] [--json OUT]

Compiles each variant (forward, or backward behind ``bwd:``) for sm_90a as
``hf_flash.kernels.hopper.compile_check`` does (bf16, causal and not), disassembles the cubin with
Triton's nvdisasm and finds the consumers' main loops: the loops (a backward branch) whose body
holds a step's exponentials (one ``MUFU.EX2`` per score a thread holds: 64 for the forward's 64 x
128 tiles, 32 for the d128 backward's 64 x 64, 64 for the d64 backward's 128 x 64). For each it
reports the instructions of the loop's shortest path from its head to its back edge - the step
that needs no mask, where the masking arm is a branch of its own - and that path's mix: the
softmax's essential work (FMNMX, FFMA, MUFU.EX2, FADD, FMUL, F2FP) and what else runs there
(FSEL: masking; PRMT: byte permutes of the P operand). Branches out of the loop's address range
(the out-of-line retry loops of the barrier waits) count as not taken.

Found with it (Triton 3.6's ptxas, BLOCK_N = 128): the step without a mask is 420-439
instructions per warp at d64 and 463 at d128, causal or not (336 / 368 of them the softmax's
essential work); the masking arm is a branch of its own (the loop body 500-700). The third of
the three d64 consumers carries 32 PRMT per step that the others do not (P's bf16 halves swapped
after the pack: 467). Counting the loop body instead of the path once read as "the non-causal
mask runs on every tile" and led to a mask-free copy of the step that measured 0.95-0.99x
(.notes/hopper.md, session 34). Backward: the d128 step is 397 instructions non-causal (an
FMUL, an FSEL - the key-tail mask, if-converted - and an FADD per score before the exponential)
and 396 causal; forms without the FSELs (one FFMA per score: 330-347; FMUL and FADD kept apart:
364) measured 0.88-0.95x non-causal (.notes/hopper-bwd.md): as in the forward, fewer
instructions did not mean a faster step.

Set TRITON_INTERPRET=0 (the tests' interpreter mode replaces Triton's kernels with Python objects).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.diagnostics.wgmma_wait_order import sass  # noqa: E402
from hf_flash.kernels.hopper import attention_bwd, attention_fwd, compile_check  # noqa: E402

DEFAULT_VARIANTS = ("ws3x4-pp-s3", "ws2x4-overlap-fma", "ws2x4-overlap-fma-dyn")
ESSENTIAL = ("FMNMX", "FFMA", "MUFU.EX2", "FADD", "FMUL", "F2FP.BF16.F32.PACK_AB", "F2FP.F16.F32.PACK_AB")
SHOWN = ESSENTIAL + ("FSEL", "PRMT", "HGMMA", "BAR.SYNC", "SHFL.BFLY")
_INSTR = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")


def parse(text: str) -> list[tuple[int, str, str | None]]:
    """(address, instruction, branch target address or None) for each instruction of nvdisasm's
    output (its ``.L_x_N:`` labels resolved to the addresses they precede)."""
    out, labels, pending = [], {}, []
    for line in text.splitlines():
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSTR.match(line)
        if m:
            addr = int(m.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            t = _TARGET.search(m.group(2))
            out.append((addr, m.group(2), t.group(1) if t else None))
    return [(a, ins, labels.get(t) if t else None) for a, ins, t in out]


def opcode(ins: str) -> str:
    ins = re.sub(r"^@!?U?P\w+\s+", "", ins)
    op = ins.split()[0]
    return "HGMMA" if op.startswith("HGMMA") else ("BAR.SYNC" if op.startswith("BAR.SYNC") else op)


def step_paths(instrs: list[tuple[int, str, int | None]], min_exp: int = 64) -> list[dict]:
    """Per main loop (a backward branch over a body with >= ``min_exp`` MUFU.EX2): its address
    range, the shortest head-to-back-edge path's length and mix, and the whole body's length."""
    index = {a: i for i, (a, _, _) in enumerate(instrs)}
    loops = []
    for i, (addr, ins, target) in enumerate(instrs):
        if target is None or target >= addr:
            continue
        head = index[target]
        body = instrs[head:i + 1]
        if sum(opcode(x) == "MUFU.EX2" for _, x, _ in body) < min_exp:
            continue
        # shortest path (in instructions) from the head to this back edge, inside [head, i]:
        # breadth first over fall-through and forward branch edges
        dist, queue, prev = {head: 1}, collections.deque([head]), {}
        while queue:
            k = queue.popleft()
            _, ins_k, tgt = instrs[k]
            nexts = []
            unconditional = opcode(ins_k) == "BRA" and not ins_k.lstrip().startswith("@")
            if not unconditional and k + 1 <= i:
                nexts.append(k + 1)
            if tgt is not None and target <= tgt <= addr and tgt > instrs[k][0]:
                nexts.append(index[tgt])
            for n in nexts:
                if n not in dist:
                    dist[n], prev[n] = dist[k] + 1, k
                    queue.append(n)
        if i not in dist:
            continue
        path, k = [i], i
        while k != head:
            k = prev[k]
            path.append(k)
        mix = collections.Counter(opcode(instrs[k][1]) for k in path)
        if mix["MUFU.EX2"] < min_exp:
            continue  # an outer loop (items of a persistent program): its shortest path skips the step
        loops.append({
            "head": hex(target), "back_edge": hex(addr), "body": len(body), "step": len(path),
            "essential": sum(mix[o] for o in ESSENTIAL), "mix": {o: mix[o] for o in SHOWN if mix[o]},
        })  # fmt: skip
    # nested back edges to one head: keep the innermost (the shortest body) per head
    inner = {}
    for rec in loops:
        if rec["head"] not in inner or rec["body"] < inner[rec["head"]]["body"]:
            inner[rec["head"]] = rec
    return list(inner.values())


def _variant(name: str):
    """The forward variant ``name``, or the backward one behind ``bwd:`` (not the split-D forms,
    whose tiles are [queries, keys]); None if there is none."""
    if name.startswith(compile_check.BWD_PREFIX):
        var = attention_bwd.VARIANTS.get(name[len(compile_check.BWD_PREFIX):])
        return None if var is None or var.split_d else var
    return attention_fwd.VARIANTS.get(name)


def exponentials_per_step(var) -> int:
    """One exponential per score a consumer thread holds: a step's [block_m, block_n] tile over a
    warpgroup's 128 threads (the loops :func:`step_paths` looks for hold at least this many)."""
    return var.block_m * var.block_n // 128


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS))
    ap.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--json", type=Path, help="write the records here")
    args = ap.parse_args(argv)
    unknown = [v for v in args.variants if _variant(v) is None]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {list(attention_fwd.VARIANTS)} or "
                 f"{[compile_check.BWD_PREFIX + n for n, v in attention_bwd.VARIANTS.items() if not v.split_d]}")
    records = []
    for name in args.variants:
        var = _variant(name)
        for d in args.head_dims:
            if d not in var.head_dims:
                continue
            for causal in (False, True):
                compiled, *_ = compile_check.compile_variant(name, d, causal, torch.bfloat16)
                loops = step_paths(parse(sass(compiled.asm["cubin"])), min_exp=exponentials_per_step(var))
                records.append({"variant": name, "head_dim": d, "causal": causal, "loops": loops})
                for rec in loops:
                    mix = " ".join(f"{k}={v}" for k, v in rec["mix"].items())
                    print(f"{name:24s} d{d:<4d} {'causal' if causal else 'full  '} loop {rec['head']}: "
                          f"step {rec['step']} instructions (essential {rec['essential']}; body {rec['body']}) "
                          f"{mix}", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
