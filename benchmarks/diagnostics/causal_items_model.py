"""A tile-count model of the Gluon forward's causal work items (no GPU).

    python benchmarks/diagnostics/causal_items_model.py [--seqlens 4096 8192 16384 32768]
        [--rows 192] [--block-m 64] [--block-n 128]

A causal item is ROWS query rows split among ROWS / BLOCK_M consumers; each consumer runs a
series of BLOCK_N-key tiles, one wgmma pair and one softmax step each. This counts, per head
(seqlen_q == seqlen_k), the consumer-tiles the kernel runs under two alignments of the items
and two per-consumer rules, against the tiles the causal triangle needs:

- ``start``: items from row 0 (m0 = i * ROWS): when ROWS does not divide the length, the last
  item holds the last rows and runs every key tile on every consumer, the ones past the end too.
- ``end``: items ending at the last BLOCK_M-row block (the kernel's form): the partial
  item holds the first rows; its blocks before row 0 run one tile (or none with ``own``).
- ``item``: every consumer runs the item's key tiles (up to the item's last row).
- ``own``: a consumer runs only the tiles its own rows see (``_own_tiles``; the others it passes
  through, ``_pass_tiles``: waits and a turn, no math), at least one.

``needed`` is the least any tiling of BLOCK_M-row blocks and BLOCK_N-key tiles can run: each
block's own tiles. Found with it (d64 default: 192 rows, 64 per consumer, 128-key tiles):
at 4K ``start``/``item`` runs 1,152 consumer-tiles per head, ``end``/``item`` 1,089 (-5.5%),
``end``/``own`` 1,058 (-2.8% more; needed 1,056); measured at d64 causal 4K on an H200: 1.055x,
then 1.012x (a passed tile still costs its waits and turn). 8K: 4,287 / 4,224 / 4,161 (1.017x,
1.004x measured). At 128 rows (d128) every count equals ``needed`` at 4K-32K.
"""

from __future__ import annotations

import argparse
import math


def consumer_tiles(seqlen: int, rows: int, block_m: int, block_n: int, align: str, rule: str) -> int:
    """Consumer-tiles of one head's causal items (seqlen_q == seqlen_k == seqlen)."""
    if rows % block_m:
        raise ValueError(f"rows ({rows}) must be a multiple of block_m ({block_m})")
    consumers = rows // block_m
    n_items = math.ceil(seqlen / rows)
    blocks = math.ceil(seqlen / block_m)
    total = 0
    for i in range(n_items):
        m0 = i * rows if align == "start" else (blocks - (n_items - i) * consumers) * block_m
        # the item's key tiles: up to its last row (keys of the rows past the end exist only up
        # to seqlen); a consumer's own: up to its own last row, at least one
        item_tiles = math.ceil(min(seqlen, max(m0 + rows, 0)) / block_n)
        for c in range(consumers):
            last = m0 + (c + 1) * block_m  # one past the consumer's last row
            own = max(math.ceil(min(seqlen, max(last, 0)) / block_n), 1)
            total += item_tiles if rule == "item" else min(own, item_tiles)
    return total


def needed_tiles(seqlen: int, block_m: int, block_n: int) -> int:
    """Each BLOCK_M-row block's own key tiles: what no item shape can go below."""
    return sum(math.ceil(min(seqlen, b * block_m + block_m) / block_n) for b in range(math.ceil(seqlen / block_m)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens", nargs="+", type=int, default=[4096, 8192, 16384, 32768])
    ap.add_argument("--rows", type=int, default=192, help="query rows per item (consumers x block-m)")
    ap.add_argument("--block-m", type=int, default=64, help="query rows per consumer")
    ap.add_argument("--block-n", type=int, default=128, help="keys per tile")
    args = ap.parse_args(argv)
    combos = [("start", "item"), ("end", "item"), ("end", "own")]
    print(f"consumer-tiles per head, {args.rows} rows per item, {args.block_m} per consumer, "
          f"{args.block_n}-key tiles (/needed)")  # fmt: skip
    print(f"{'seqlen':>7} " + " ".join(f"{a + '/' + r:>16}" for a, r in combos) + f" {'needed':>8}")
    for s in args.seqlens:
        need = needed_tiles(s, args.block_m, args.block_n)
        cells = []
        for align, rule in combos:
            n = consumer_tiles(s, args.rows, args.block_m, args.block_n, align, rule)
            cells.append(f"{n:>8} ({n / need:.3f})")
        print(f"{s:>7} " + " ".join(cells) + f" {need:>8}")


if __name__ == "__main__":
    main()
