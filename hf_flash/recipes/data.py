"""Documents in, packed rows out.

Packing: tokenised documents are laid end to end and cut into rows of exactly ``seq_len`` tokens,
so no padding is ever computed. ``position_ids`` restart at 0 at every document start (and at the
start of every row, where a document cut by a row boundary continues as a fresh segment). Given
one row with restarting ``position_ids`` and no attention mask, transformers treats the row as
packed sequences: flash-style implementations (hf_flash) run varlen attention over the segments
and the mask-based ones (sdpa, eager) build a block-diagonal causal mask. Labels are the next
token inside the same segment and ``-100`` where the next token starts another segment, so no
token is trained to predict across a document boundary.

A micro-batch of several rows is flattened into one row of ``micro_batch_size * seq_len`` tokens;
this is equivalent because every row starts a new segment.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

from .config import ConfigError

IGNORE_INDEX = -100


# ------------------------------------------------------------------------------------------------
# Tokenizer of the embedded tiny model
# ------------------------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255 plus BOS and EOS: needs no files, round-trips any text."""

    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id] + ids if add_special_tokens else ids

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save_pretrained(self, path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "byte_tokenizer.json").write_text(
            json.dumps({"type": "ByteTokenizer", "bos": self.bos_token_id, "eos": self.eos_token_id})
        )


class HFTokenizer:
    """Adapter over a transformers tokenizer with the same small interface as ByteTokenizer."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)
        self.bos_token_id = self.tok.bos_token_id
        self.eos_token_id = self.tok.eos_token_id
        self.vocab_size = len(self.tok)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tok(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids))

    def save_pretrained(self, path) -> None:
        self.tok.save_pretrained(path)


def load_tokenizer(path: Optional[str]):
    if path is None:
        return ByteTokenizer()
    if (Path(path) / "byte_tokenizer.json").is_file():
        return ByteTokenizer()
    return HFTokenizer(path)


# ------------------------------------------------------------------------------------------------
# Documents
# ------------------------------------------------------------------------------------------------

_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ",
    "A river runs through the valley and the wind moves over the hills. ",
    "Numbers are counted one by one, and the list goes on without an end. ",
    "The old library keeps its books in long quiet rows. ",
)


def synthetic_documents(n: int, seed: int, min_chars: int, max_chars: int) -> list[str]:
    """Long documents with something to learn at long range: each hides a five-digit pass key
    early in filler text and asks for it again at the end."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        target = rng.randint(min_chars, max_chars)
        key = f"{rng.randint(0, 99999):05d}"
        head = f"The pass key is {key}. Remember it. {key} is the pass key. "
        tail = f"What is the pass key? The pass key is {key}."
        parts, size = [], len(head) + len(tail)
        while size < target:
            s = rng.choice(_FILLER)
            parts.append(s)
            size += len(s)
        cut = rng.randint(0, len(parts))
        docs.append("".join(parts[:cut]) + head + "".join(parts[cut:]) + tail)
    return docs


def _read_json_lines(path: Path, field: str) -> Iterator[str]:
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{lineno}: expected a JSON object with field {field!r}")
            if field not in row:
                raise ConfigError(f"{path}:{lineno} has no field {field!r} (set text_field)")
            yield row[field]


def _read_file(path: Path, field: str) -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _read_json_lines(path, field)
    elif suffix == ".json":
        try:
            rows = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(rows, list):
            raise ConfigError(f"{path}: expected a JSON list of objects with field {field!r}")
        for i, row in enumerate(rows):
            if not isinstance(row, dict) or field not in row:
                raise ConfigError(f"{path}[{i}] has no field {field!r} (set text_field)")
            yield row[field]
    elif suffix in (".txt", ".md", ".text", ""):
        yield path.read_text(encoding="utf-8", errors="replace")
    else:
        raise ConfigError(f"{path}: unsupported data file type {suffix!r} (use .jsonl, .json, .txt, .md)")


def read_documents(paths: list, text_field: str) -> list[str]:
    """Texts from local files and directories, in sorted path order."""
    docs: list[str] = []
    for p in map(Path, paths):
        if p.is_dir() and ((p / "dataset_info.json").is_file() or (p / "state.json").is_file()):
            try:
                import datasets
            except ImportError as e:
                raise ConfigError(
                    f"{p} is a `datasets` directory but the `datasets` package is not installed"
                ) from e
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds["train"] if "train" in ds else next(iter(ds.values()))
            if text_field not in ds.column_names:
                raise ConfigError(f"{p} has no column {text_field!r}; columns: {ds.column_names}")
            docs.extend(ds[text_field])
        elif p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in (".jsonl", ".json", ".txt", ".md"))
            if not files:
                raise ConfigError(f"data directory {p} holds no .jsonl/.json/.txt/.md files")
            for f in files:
                docs.extend(_read_file(f, text_field))
        else:
            docs.extend(_read_file(p, text_field))
    docs = [d for d in docs if isinstance(d, str) and d.strip()]
    if not docs:
        raise ConfigError(f"no non-empty documents found in {paths}")
    return docs


# ------------------------------------------------------------------------------------------------
# Packing
# ------------------------------------------------------------------------------------------------


@dataclass
class PackedRows:
    """``input_ids`` and ``position_ids``, both ``(num_rows, seq_len)`` int32."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    num_documents: int
    dropped_tokens: int

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]


def pack_documents(token_docs: list[list[int]], seq_len: int) -> PackedRows:
    """Concatenate documents and cut full rows; position ids restart per document and per row.
    The tail that does not fill a last row is dropped (counted in ``dropped_tokens``)."""
    if not token_docs:
        raise ConfigError("no documents to pack")
    ids = torch.cat([torch.as_tensor(doc, dtype=torch.int32) for doc in token_docs])
    pos = torch.cat([torch.arange(len(doc), dtype=torch.int32) for doc in token_docs])
    n_rows = ids.numel() // seq_len
    used = n_rows * seq_len
    input_ids = ids[:used].view(n_rows, seq_len)
    position_ids = pos[:used].clone().view(n_rows, seq_len)
    if n_rows:
        # a document cut by a row boundary continues as a new segment at position 0
        col0 = position_ids[:, 0].clone()
        position_ids -= torch.where(
            torch.cumsum(position_ids == 0, dim=1) == 0, col0[:, None], torch.zeros_like(col0)[:, None]
        )
    return PackedRows(input_ids, position_ids, len(token_docs), ids.numel() - used)


def tokenize_documents(texts: list[str], tokenizer) -> list[list[int]]:
    docs = []
    for text in texts:
        ids = tokenizer.encode(text)
        if tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id] + ids
        if tokenizer.eos_token_id is not None:
            ids = ids + [tokenizer.eos_token_id]
        if len(ids) >= 2:
            docs.append(ids)
    return docs


def labels_for(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Next-token labels that never cross a segment start: ``(..., S)`` -> ``(..., S)``."""
    labels = torch.full_like(input_ids, IGNORE_INDEX, dtype=torch.long)
    same_segment = position_ids[..., 1:] != 0
    labels[..., :-1] = torch.where(same_segment, input_ids[..., 1:].long(), IGNORE_INDEX)
    return labels


def cu_seqlens_from_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Segment boundaries of a flat ``(S,)`` position row: int32 cu_seqlens and max length."""
    starts = torch.nonzero(position_ids == 0).flatten()
    ends = torch.cat([starts[1:], torch.tensor([position_ids.numel()])])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), ends]).to(torch.int32)
    return cu, int((ends - starts).max())


class PackedBatches:
    """Deterministic micro-batches over packed rows, sharded across processes.

    Micro-batch ``k`` (counted from the start of training) of process ``r`` holds rows
    ``perm_e[(j * world + r) * mbs : ... + mbs]`` with ``e = k // per_epoch`` and
    ``j = k % per_epoch``; ``perm_e`` is a permutation drawn from ``seed + e`` alone. Resuming
    at micro-batch ``k`` therefore needs only ``k``, and no global RNG is consumed.
    """

    def __init__(self, rows: PackedRows, micro_batch_size: int, rank: int, world_size: int, seed: int,
                 flash_kwargs: bool):
        self.rows = rows
        self.mbs = micro_batch_size
        self.rank = rank
        self.world = world_size
        self.seed = seed
        self.flash_kwargs = flash_kwargs
        self.per_epoch = rows.num_rows // (micro_batch_size * world_size)
        if self.per_epoch == 0:
            raise ConfigError(
                f"the data packs into {rows.num_rows} row(s) of {rows.seq_len} tokens, fewer than "
                f"micro_batch_size x processes = {micro_batch_size * world_size}; add data or "
                f"lower seq_len / micro_batch_size"
            )
        self._perm_epoch = -1
        self._perm: Optional[torch.Tensor] = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.rows.num_rows, generator=g)
            self._perm_epoch = epoch
        return self._perm

    def get(self, k: int, device) -> dict:
        epoch, j = divmod(k, self.per_epoch)
        start = (j * self.world + self.rank) * self.mbs
        idx = self._permutation(epoch)[start : start + self.mbs]
        input_ids = self.rows.input_ids[idx].reshape(1, -1)
        position_ids = self.rows.position_ids[idx].reshape(1, -1)
        batch = {
            "input_ids": input_ids.long(),
            "position_ids": position_ids.long(),
            "labels": labels_for(input_ids, position_ids),
        }
        if self.flash_kwargs:
            cu, max_len = cu_seqlens_from_positions(position_ids[0])
            batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
        return {k_: (v.to(device) if torch.is_tensor(v) else v) for k_, v in batch.items()}


def build_rows(cfg, tokenizer, log=print) -> PackedRows:
    """Read or synthesise the documents, shuffle them deterministically, tokenise and pack."""
    if cfg.data:
        texts = read_documents(cfg.data, cfg.text_field)
        source = ", ".join(cfg.data)
    else:
        # documents from a quarter to one and a half rows long, so rows mix several documents
        # and some documents cross row boundaries
        texts = synthetic_documents(
            cfg.synthetic_documents, cfg.seed, max(64, cfg.seq_len // 4), max(128, cfg.seq_len * 3 // 2)
        )
        source = f"{cfg.synthetic_documents} synthetic pass-key documents"
    random.Random(cfg.seed).shuffle(texts)
    if cfg.max_documents is not None:
        texts = texts[: cfg.max_documents]
    rows = pack_documents(tokenize_documents(texts, tokenizer), cfg.seq_len)
    log(
        f"data: {source}: {rows.num_documents} documents -> {rows.num_rows} rows of {cfg.seq_len} "
        f"tokens ({rows.dropped_tokens} tail tokens dropped)"
    )
    return rows
