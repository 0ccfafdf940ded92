"""A step-count model of the Gluon backward's ordered dQ additions, causal or unmasked (no GPU).

    python benchmarks/diagnostics/dq_turns_model.py [--sms 132] [--group 4] [--kv-heads 8]
        [--masks causal full] [--key-fastest G] [--block-m 64|128] [--window W]

The deterministic backward adds each (batch, head, 64-row query tile) of dQ in a fixed order of
the key blocks (128 keys per program): a program's writer waits until every block before it in
that order has added the tile. This counts what those waits cost, with every step (one query
tile of one head) taking one unit of time and an addition landing at the end of its step:
programs take the SMs in launch order (one per SM, the next one as an SM frees up), each walks
its query tiles in its order and, at a tile, waits until its turn has come. The model ignores
everything else (masking, the dQ writer's lag, memory); it says how much of the work the turns
alone leave idle, for the walks and turn orders below:

- ``ascending``: the kernel's order (turns by ascending key block, tiles upwards head by head);
  under causal masking a block has two tiles per head fewer than the block below it and waits
  for it at every head boundary.
- ``tiles_down``: the same turns, tiles from the last down with the heads inside each tile
  (``Variant.tiles_down``).
- ``rounds_desc``: a persistent form: 132 programs each taking every 132nd item, turns ordered
  by round and, inside a round, by descending key block.
- ``none``: no turns (the unordered additions of the non-deterministic variants).

``--key-fastest G`` launches the programs in chunks of G (batch, K/V head) pairs, key block
slower than the pair inside a chunk (``Variant.key_fastest``): causal ``tiles_down`` keeps
0.971-0.997 of the work busy with G = 4 and 0.884-0.995 with G = 2 at 4K-32K (measured, chunks
of four ran 0.97-1.02x chunks of two at 512-32K: the chunks' tail the model counts at 4K does not
show in the kernel). ``--block-m 128``: the d64 forms' steps of 128 query rows; there the upward
walk keeps 0.89-0.94 of the causal work busy at 4K-32K and ``tiles_down`` 0.987-0.997 (the d64
causal default walks down since; measured 1.00-1.07x the upward walk).

Found with it (bar shapes, Hq=32, Hkv=8, 132 SMs): ``ascending`` keeps 0.89-0.94 of the work
busy at 4K-32K, ``none`` 0.99+; ``tiles_down`` 0.99 (on the global-statistics form, session 20,
that walk lost L2 reuse instead; on the stats form, session 31, it gained 1-5% and is the causal
default); ``rounds_desc`` does not help (0.89-0.94: its rounds wait on the previous round's
longest blocks).

``--window W`` (causal, a left window of W keys, the ascending turns starting at the lowest
key block that sees a tile, as the kernel's ``_first_key_block``): at Hq=32, Hkv=8 the
tiles-down walk every windowed dense call takes keeps 0.986-0.998 of the work busy with W = 4096
and 0.939-0.981 with W = 1024 (4K-32K, 64 or 128 rows per step), within 0.7% of no turns at
all; what idles at W = 1024 is the launch's last wave (equal programs, 4-6% at 8K-32K).

Without masking (``--masks full``) every block walks every tile: the turns cost ~0.1%
(0.968-0.969 against 0.970 without turns at 4K-32K); what idles is the last wave (1,024 or 2,048
equal programs on 132 SMs: 7.8 or 15.5 waves).
"""

from __future__ import annotations

import argparse
import heapq
from collections import defaultdict

ORDERS = ("ascending", "tiles_down", "rounds_desc", "none")
SHAPES = ((4096, 4), (8192, 2), (16384, 1), (32768, 1))  # (S, B): 16K tokens per batch below 32K


def tile_range(kb, seqlen, block_m=64, keys=128, causal=True, window=-1):
    """(first, last) query tile that sees key block ``kb``: causal from the tile holding the
    block's first key; with a left window of ``window`` keys (causal only) up to the tile
    holding row (last key + window); otherwise every tile."""
    n_tiles = seqlen // block_m
    if not causal:
        return 0, n_tiles - 1
    last = n_tiles - 1 if window < 0 else min(n_tiles - 1, (kb * keys + keys - 1 + window) // block_m)
    return kb * keys // block_m, last


def programs(seqlen, batch, kv_heads, group, tiles_down=False, block_m=64, keys=128, causal=True,
             key_fastest=0, window=-1):  # fmt: skip
    """(bhk, key block, walk) in launch order; walk = [(head, tile), ...]. Launch order: key
    block slowest, or (``key_fastest`` = g > 0, ``Variant.key_fastest``) chunks of g (batch, K/V
    head) pairs, the key block slower than the pair inside a chunk."""
    n_bhk = batch * kv_heads

    def walk(kb):
        first, last = tile_range(kb, seqlen, block_m, keys, causal, window)
        if tiles_down:
            return [(h, t) for t in range(last, first - 1, -1) for h in range(group)]
        return [(h, t) for h in range(group) for t in range(first, last + 1)]

    blocks = range(seqlen // keys)
    if key_fastest:
        chunks = [range(c, min(c + key_fastest, n_bhk)) for c in range(0, n_bhk, key_fastest)]
        return [(bhk, kb, walk(kb)) for chunk in chunks for kb in blocks for bhk in chunk]
    return [(bhk, kb, walk(kb)) for kb in blocks for bhk in range(n_bhk)]


def _rounds_desc_ranks(progs, sms, n_bhk, keys_per_tile=2):
    """rank(i, tile): the additions to that tile before program i's, ordered by (round, key
    block descending)."""
    rnd = [i // sms for i in range(len(progs))]

    def rank(i, tile):
        bhk, kb, _ = progs[i]
        top = tile // keys_per_tile  # the highest key block whose keys the tile sees
        same = [k for k in range(top + 1) if rnd[k * n_bhk + bhk] == rnd[i]]
        return sum(1 for k in range(top + 1) if rnd[k * n_bhk + bhk] < rnd[i]) + sum(1 for k in same if k > kb)

    return rank


def simulate(seqlen, batch, order, sms=132, kv_heads=8, group=4, causal=True, key_fastest=0, block_m=64,
             window=-1):  # fmt: skip
    """(makespan in steps, the work divided by the SMs); ``block_m`` query rows per step (64: the
    d128 forms, 128: the d64 ones); ``window``: a left window in keys (causal only), where a
    tile's turns start at the lowest key block that sees it."""
    if window >= 0 and (not causal or order == "rounds_desc"):
        raise ValueError("a window is modelled with causal masking and the ascending turns only")
    progs = programs(seqlen, batch, kv_heads, group, tiles_down=order == "tiles_down", causal=causal,
                     key_fastest=key_fastest, block_m=block_m, window=window)  # fmt: skip
    work = sum(len(w) for _, _, w in progs)
    if order == "none":
        free = [0] * sms
        end = 0
        for _, _, walk in progs:
            start = heapq.heappop(free)
            heapq.heappush(free, start + len(walk))
            end = max(end, start + len(walk))
        return end, work / sms
    if order == "rounds_desc":
        if not causal:
            raise ValueError("rounds_desc models causal programs only (its ranks assume causal tiles)")
        rank = _rounds_desc_ranks(progs, sms, batch * kv_heads, keys_per_tile=128 // block_m)
        queues = [list(range(c, len(progs), sms)) for c in range(sms)]
    else:
        # ascending key blocks: the blocks below this one that see the tile add first
        lowest = {}
        for kb in range(seqlen // 128):
            first, last = tile_range(kb, seqlen, block_m, 128, causal, window)
            for t in range(first, last + 1):
                lowest.setdefault(t, kb)
        rank = lambda i, tile: progs[i][1] - lowest[tile]  # noqa: E731
        queues = None
    counter = defaultdict(int)
    pos = [0] * len(progs)
    running = [None] * sms
    launched = 0
    ranks = {}
    steps = 0
    while True:
        for s in range(sms):
            if running[s] is None:
                if queues is not None:
                    running[s] = queues[s].pop(0) if queues[s] else None
                elif launched < len(progs):
                    running[s], launched = launched, launched + 1
        if all(r is None for r in running):
            return steps, work / sms
        added = []
        for s in range(sms):
            i = running[s]
            if i is None:
                continue
            bhk, _, walk = progs[i]
            h, tile = walk[pos[i]]
            if (i, tile) not in ranks:
                ranks[(i, tile)] = rank(i, tile)
            if counter[(bhk, h, tile)] == ranks[(i, tile)]:
                added.append((bhk, h, tile))
                pos[i] += 1
                if pos[i] == len(walk):
                    running[s] = None
        for key in added:
            counter[key] += 1
        steps += 1


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--group", type=int, default=4, help="query heads per K/V head")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--orders", nargs="+", choices=ORDERS, default=None,
                    help="default: all for causal, ascending and none for full")  # fmt: skip
    ap.add_argument("--masks", nargs="+", choices=("causal", "full"), default=["causal"])
    ap.add_argument("--block-m", type=int, default=64, choices=(64, 128),
                    help="query rows per step: 64 (the d128 forms) or 128 (the d64 ones)")
    ap.add_argument("--key-fastest", type=int, default=0,
                    help="launch order in chunks of this many (batch, K/V head) pairs, key block fastest")  # fmt: skip
    ap.add_argument("--window", type=int, default=-1, help="a left window in keys (causal; ascending turns)")
    args = ap.parse_args(argv)
    for mask in args.masks:
        causal = mask == "causal"
        orders = args.orders or (list(ORDERS) if causal else ["ascending", "none"])
        if args.window >= 0:
            orders = [o for o in orders if o != "rounds_desc"]
        for seqlen, batch in SHAPES:
            cells = []
            for order in orders:
                span, ideal = simulate(seqlen, batch, order, args.sms, args.kv_heads, args.group, causal,
                                       args.key_fastest, args.block_m, args.window)  # fmt: skip
                cells.append(f"{order} {ideal / span:.3f}")
            print(f"{mask} S={seqlen:5d} B={batch}: busy share " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
