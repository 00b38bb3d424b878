"""Data at pre-training scale: ``datasets``-backed loading, tokenizing and packing into fixed blocks.

Three sources, one output: fixed ``block_size`` blocks of ``input_ids`` and ``labels``. Labels are the
inputs (the model shifts them), with ``-100`` on the tokens outside the completions when the records
were tokenized with ``completion_only=True`` (:func:`tokenize` then adds a ``completion_mask`` column
that is packed into the same blocks as the ids; pre-tokenized files have no such structure and train
on every token):

- :func:`packed_dataset`: a map-style :class:`BlockDataset` over Arrow. Records are read by
  ``datasets`` (memory-mapped, cached), tokenized with ``Dataset.map`` (``num_proc`` workers, cached
  by fingerprint), and the token stream is cut into blocks *without copying*: block ``i`` is the
  ``i``-th ``block_size`` slice of the flattened, memory-mapped token column. Memory stays bounded by
  Arrow's write batches, not by the file.
- :class:`StreamingBlocks`: ``load_dataset(..., streaming=True)`` for corpora larger than disk or
  memory; records are tokenized on the fly and packed into blocks by an iterator that carries the
  remainder across records (static shapes). Its position (:meth:`StreamingBlocks.position`) is the ``datasets`` stream
  position plus the carried tokens, saved with each checkpoint, so a resumed run continues where the
  checkpoint was without reading and tokenizing the stream from the start (formats whose ``datasets``
  reader can seek; others re-read, but do not re-tokenize, up to the position).
- :class:`TokenFileBlocks`: a directory of pre-tokenized files (``.npy``, or raw ``.bin`` of
  ``uint16``/``uint32``/``int32``) read with memory mapping; random access, so resuming is free.

Every record error names the file and the line (JSON lines), the record (JSON arrays) or the row
(parquet, Hub datasets), counted in file order.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from .records import LOCAL_FORMATS, DataFormatError, DataNotFoundError, format_segments, iter_jsonl

TOKEN_FILE_DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32}
_MAP_BATCH = 1000  # records per tokenizer call / Arrow write batch


class RecordError(DataFormatError):
    """A record that cannot be used, by its index in file order (the caller turns it into a location)."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index, self.message = index, message

    def __reduce__(self):  # crosses ``num_proc`` worker processes intact
        return RecordError, (self.index, self.message)


# ----------------------------------------------------------------------------------- locations
class Locator:
    """Turns a record's index (file order) into ``file, line N`` / ``file, record N`` / ``name, row N``."""

    def __init__(self, dataset: str):
        self.dataset = dataset
        self.kind = ("jsonl" if dataset.endswith(".jsonl") else "json" if dataset.endswith(".json")
                     else "row")

    def __call__(self, index: int) -> str:
        if self.kind == "jsonl":
            return f"{self.dataset}, line {_jsonl_line_of(self.dataset, index)}"
        if self.kind == "json":
            return f"{self.dataset}, record {index}"
        return f"{self.dataset}, row {index}"


def _jsonl_line_of(path: str, index: int) -> int:
    """1-based line number of the ``index``-th non-blank line (blank lines hold no record)."""
    seen = -1
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                seen += 1
                if seen == index:
                    return lineno
    return lineno + 1 if seen >= 0 else 1


def _scan_jsonl(path: str) -> None:
    """Raise a ``DataFormatError`` naming the first line that is not a JSON object (the error path of a
    fast Arrow read that failed: Arrow's own messages name neither the line nor the file)."""
    for _ in iter_jsonl(path):
        pass


# ------------------------------------------------------------------------------------- loading
def load_raw(dataset: str, split: str = "train", streaming: bool = False):
    """A ``datasets.Dataset`` (or ``IterableDataset`` when streaming) of the raw records of a local
    .json/.jsonl/.parquet file or a Hub dataset. Errors name the file and line (or the dataset)."""
    import datasets

    local = dataset.endswith(LOCAL_FORMATS) or os.path.exists(dataset)
    if local:
        if not os.path.isfile(dataset):
            raise DataNotFoundError(f"--dataset {dataset!r}: no such file")
        if not dataset.endswith(LOCAL_FORMATS):
            raise DataFormatError(f"--dataset {dataset!r}: local files must end in {', '.join(LOCAL_FORMATS)} "
                                  "(or use --token_files for a directory of pre-tokenized files)")
        builder = "parquet" if dataset.endswith(".parquet") else "json"
        if dataset.endswith(".json"):
            _check_json_array(dataset)  # a .json is read whole anyway; its errors deserve a location
        import logging

        # it logs Arrow's message about a malformed file (also while streaming); ours names the line instead
        logging.getLogger("datasets.packaged_modules.json.json").setLevel(logging.CRITICAL)
        try:
            return datasets.load_dataset(builder, data_files=dataset, split="train", streaming=streaming)
        except Exception as e:  # Arrow's messages name neither file nor line: find it ourselves
            if dataset.endswith(".jsonl"):
                _scan_jsonl(dataset)
            raise DataFormatError(f"{dataset}: not readable as {builder} ({str(e).splitlines()[0][:200]})") from None
    try:
        return datasets.load_dataset(dataset, split=split, streaming=streaming)
    except Exception as e:
        raise DataNotFoundError(f"--dataset {dataset!r}: not a local file, and the Hub dataset could not be loaded "
                                f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None


def _check_json_array(path: str) -> None:
    from .records import _read_json

    _read_json(path)


# ----------------------------------------------------------------------------------- tokenizing
def tokenizer_fingerprint(tokenizer) -> str:
    """A stable hash of what tokenizing depends on (for ``datasets``' cache)."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(tokenizer).encode())
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    h.update(str(tokenizer.eos_token_id).encode())
    return h.hexdigest()[:16]


def _tokenize_fn(tokenizer, completion_only: bool = False) -> Callable:
    eos = tokenizer.eos_token_id

    def fn(batch: dict, indices: list[int]) -> dict:
        keys = list(batch)
        segments = []
        for j, index in enumerate(indices):
            record = {k: batch[k][j] for k in keys if batch[k][j] is not None}  # Arrow fills absent keys with None
            try:
                segments.append(format_segments(record, tokenizer, where=""))
            except DataFormatError as e:
                raise RecordError(index, str(e).removeprefix(": ")) from None
        texts = ["".join(t for t, _ in segs) for segs in segments]
        if not completion_only:
            ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
            return {"input_ids": [x + [eos] for x in ids]}
        ids, masks = [], []
        for x, m in (_tokenize_masked(texts, segments, tokenizer)):
            ids.append(x + [eos])
            masks.append(m + [1])  # EOS is trained on: the model learns where a document or completion ends
        return {"input_ids": ids, "completion_mask": masks}

    return fn


def _tokenize_masked(texts: list[str], segments: list[list[tuple[str, bool]]], tokenizer):
    """(token ids of each text, 1 where the token is trainable else 0). A fast tokenizer tokenizes the
    whole text (the same ids as without masking) and a token is trainable when its first character is;
    a slow one tokenizes segment by segment."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        for ids, offsets, segs in zip(enc["input_ids"], enc["offset_mapping"], segments):
            starts, flags, pos = [], [], 0
            for text, trainable in segs:
                starts.append(pos)
                flags.append(int(trainable))
                pos += len(text)
            yield ids, [flags[bisect.bisect_right(starts, a) - 1] if starts else 1 for a, _ in offsets]
        return
    for segs in segments:
        ids, mask = [], []
        for text, trainable in segs:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            mask += [int(trainable)] * len(piece)
        yield ids, mask


def tokenize(ds, tokenizer, locate: Callable[[int], str], num_proc: int | None = None,
             completion_only: bool = False):
    """Each record's formatted text as token ids followed by EOS (column ``input_ids``), in file order;
    with ``completion_only`` also ``completion_mask`` (1: a completion/assistant/text token or EOS, trained
    on; 0: a prompt token, label -100), see :func:`hf_lowbit.data.format_segments`.

    ``ds`` a ``Dataset`` (tokenized once with ``num_proc`` workers and cached) or an ``IterableDataset``
    (tokenized lazily as it is read). A bad record raises ``DataFormatError`` with ``locate(index)``.
    """
    import datasets

    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token: packing needs one to separate documents")
    fn = _tokenize_fn(tokenizer, completion_only)
    if isinstance(ds, datasets.IterableDataset):
        return _LocatedIterable(ds.map(fn, batched=True, batch_size=_MAP_BATCH, with_indices=True,
                                       remove_columns=list(ds.column_names or [])), locate)
    version = "v2-completion-mask" if completion_only else "v1"
    fingerprint = hashlib.sha256(
        f"{ds._fingerprint}-{tokenizer_fingerprint(tokenizer)}-{version}".encode()).hexdigest()[:16]
    columns = {"input_ids": datasets.Sequence(datasets.Value("int32"))}  # half of int64's disk
    if completion_only:
        columns["completion_mask"] = datasets.Sequence(datasets.Value("int8"))
    features = datasets.Features(columns)
    try:
        return ds.map(fn, batched=True, batch_size=_MAP_BATCH, with_indices=True, remove_columns=ds.column_names,
                      features=features,
                      num_proc=num_proc if num_proc and num_proc > 1 and len(ds) >= 2 * _MAP_BATCH else None,
                      new_fingerprint=fingerprint, desc="Tokenizing")
    except RecordError as e:
        raise DataFormatError(f"{locate(e.index)}: {e.message}") from None


class _LocatedIterable:
    """A tokenized ``IterableDataset`` whose record errors carry the file location."""

    def __init__(self, ds, locate):
        self.ds, self.locate = ds, locate

    def __iter__(self):
        import pyarrow as pa

        try:
            yield from self.ds
        except GeneratorExit:  # closed early (or at exit, when module globals may be gone)
            raise
        except RecordError as e:
            raise DataFormatError(f"{self.locate(e.index)}: {e.message}") from None
        except pa.ArrowException as e:  # a malformed file, found as the stream reaches it
            path = getattr(self.locate, "dataset", "")
            if path.endswith(".jsonl"):
                _scan_jsonl(path)
            raise DataFormatError(f"{path}: not readable ({str(e).splitlines()[0][:200]})") from None

    def state_dict(self) -> dict:
        return self.ds.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.ds.load_state_dict(state)


# -------------------------------------------------------------------------------------- packing
class BlockDataset(Dataset):
    """Fixed-length blocks over one flat token array (Arrow, memory-mapped when cached, or numpy):
    block ``i`` is tokens ``[i * block_size, (i + 1) * block_size)``; nothing is copied up front.
    ``mask`` (optional, parallel to ``tokens``): 0 where the label is -100."""

    def __init__(self, tokens, block_size: int, mask=None):
        self.tokens, self.block_size, self.mask = tokens, block_size, mask
        self.n_tokens = len(tokens)
        self._n = self.n_tokens // block_size

    def __len__(self) -> int:
        return self._n

    def _slice(self, array, i: int) -> np.ndarray:
        if not -self._n <= i < self._n:
            raise IndexError(i)
        i %= self._n
        piece = array.slice(i * self.block_size, self.block_size) if hasattr(array, "slice") \
            else array[i * self.block_size:(i + 1) * self.block_size]
        return np.asarray(piece.to_numpy() if hasattr(piece, "to_numpy") else piece)

    def block(self, i: int) -> np.ndarray:
        return self._slice(self.tokens, i)

    def __getitem__(self, i: int) -> dict:
        ids = torch.from_numpy(self.block(i).astype(np.int64))
        mask = None if self.mask is None else torch.from_numpy(self._slice(self.mask, i).astype(bool))
        return _example(ids, mask)


def _example(ids: torch.Tensor, mask: torch.Tensor | None) -> dict:
    """A block for the Trainer: labels are the ids (the model shifts them), -100 where ``mask`` is False."""
    return {"input_ids": ids, "labels": ids.clone() if mask is None else ids.masked_fill(~mask, -100)}


def packed_dataset(tokenized, block_size: int) -> BlockDataset:
    """Blocks of ``block_size`` over the concatenation of a tokenized ``Dataset``'s ``input_ids`` (in its
    row order; a shuffled/split dataset is materialized first). The remainder is dropped."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    if getattr(tokenized, "_indices", None) is not None:
        tokenized = tokenized.flatten_indices()
    flat = {}
    for name in ("input_ids", "completion_mask"):
        if name in tokenized.column_names:
            column = tokenized.data.column(name)  # ChunkedArray of lists, memory-mapped
            flat[name] = column.combine_chunks().flatten() if column.num_chunks <= 1 else _flatten_chunked(column)
    ds = BlockDataset(flat["input_ids"], block_size, flat.get("completion_mask"))
    if len(ds) == 0:
        raise ValueError(f"the data holds {ds.n_tokens} tokens, fewer than one block of block_size={block_size}")
    return ds


def _flatten_chunked(column):
    import pyarrow as pa

    return pa.chunked_array([c.flatten() for c in column.chunks if len(c)], type=column.type.value_type)


# ------------------------------------------------------------------------------ packing texts in memory
class PackedDataset(Dataset):
    """Fixed-length blocks of token ids in one tensor (``blocks [n, block_size]``); labels are the inputs."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict:
        return _example(self.blocks[i], None)


def pack(texts: Iterable[str], tokenizer, block_size: int) -> PackedDataset:
    """Tokenize, append EOS to each text, concatenate, cut into ``block_size`` blocks (remainder dropped), all in
    memory: the packer for a list of texts (tests, the benchmarks' corpora). Files and streams take the paths above,
    which give the same blocks without holding the data."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token: packing needs one to separate documents")
    stream: list[int] = []
    for t in texts:
        stream.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        stream.append(tokenizer.eos_token_id)
    n = len(stream) // block_size
    if n == 0:
        raise ValueError(f"the data holds {len(stream)} tokens, fewer than one block of block_size={block_size}")
    return PackedDataset(torch.tensor(stream[: n * block_size], dtype=torch.long).view(n, block_size))


class StreamingBlocks(IterableDataset):
    """Packs a stream of tokenized records (``input_ids`` per record, EOS included) into blocks of
    ``block_size``, carrying the remainder across records: every block has the same shape.

    Resumable: :meth:`position` at block ``n`` (blocks handed out so far) is a recent snapshot of
    the source's position and the carried tokens; :meth:`seek` makes the next iteration start from
    there and skip the few blocks between the snapshot and ``n``. One pass over the stream: a run
    that needs more blocks than the stream holds starts it again, and resuming it replays.
    """

    def __init__(self, tokenized, block_size: int, snapshot_every: int = 64, skip_blocks: int = 0):
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {block_size}")
        self.source, self.block_size, self.snapshot_every = tokenized, block_size, snapshot_every
        self.skip_blocks = skip_blocks  # blocks of the stream's head kept for evaluation, never trained on
        self._snapshots: list[tuple[int, dict | None, list[int], list[int] | None]] = []
        self._resume: tuple[int, dict | None, list[int], list[int] | None, int] | None = None
        self.blocks_yielded = 0
        # the stream's start: what state_dict() says before any iteration (afterwards it says where the last
        # iteration stopped, e.g. after head())
        self._start_state = tokenized.state_dict() if hasattr(tokenized, "state_dict") else None

    def _iter_blocks(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None]]:
        """(block number, ids, trainable mask or None): ids and the records' ``completion_mask`` (when
        they have one) are carried and cut together, so a block's labels stay aligned with its ids."""
        bs = self.block_size
        n, buffer, mbuf, source_state = 0, [], None, self._start_state
        if self._resume is not None:
            n, source_state, buffer, mbuf, _ = self._resume
            buffer, mbuf = list(buffer), None if mbuf is None else list(mbuf)
            source_state = source_state if source_state is not None else self._start_state
        stateful = self._start_state is not None
        if stateful:
            self.source.load_state_dict(source_state)
        self._snapshots = [(n, source_state, list(buffer), None if mbuf is None else list(mbuf))]

        def cut(start):
            ids = torch.tensor(buffer[start:start + bs], dtype=torch.long)
            return ids, None if mbuf is None else torch.tensor(mbuf[start:start + bs], dtype=torch.bool)

        start = 0
        while len(buffer) - start >= bs:  # carried tokens that already make blocks
            yield n, *cut(start)
            start += bs
            n += 1
        buffer, mbuf = buffer[start:], None if mbuf is None else mbuf[start:]
        for example in self.source:
            if "completion_mask" in example:
                if mbuf is None:
                    mbuf = [1] * len(buffer)
                mbuf.extend(example["completion_mask"])
            elif mbuf is not None:
                mbuf.extend([1] * len(example["input_ids"]))
            buffer.extend(example["input_ids"])
            start = 0
            while len(buffer) - start >= bs:
                ids, mask = cut(start)
                start += bs
                n += 1
                if stateful and n % self.snapshot_every == 0:  # after this block: source position + carry
                    self._snapshots.append((n, self.source.state_dict(), buffer[start:],
                                            None if mbuf is None else mbuf[start:]))
                    del self._snapshots[:-32]  # prefetching DataLoaders run a few batches ahead
                yield n - 1, ids, mask
            buffer, mbuf = buffer[start:], None if mbuf is None else mbuf[start:]

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 1:
            raise ValueError("StreamingBlocks is one stream: with several DataLoader workers each would yield "
                             "every block; use num_workers=0 or 1")
        target = self._resume[4] if self._resume is not None else self.skip_blocks
        for n, ids, mask in self._iter_blocks():
            if n < target:
                continue
            self.blocks_yielded = n + 1
            yield _example(ids, mask)
        self._resume = None

    def head(self, n: int) -> list[dict]:
        """The first ``n`` blocks of the stream (materialized; an evaluation set)."""
        out = []
        for _, ids, mask in self._iter_blocks():
            if len(out) == n:
                break
            out.append(_example(ids, mask))
        return out

    def position(self, consumed_blocks: int) -> dict:
        """Where to resume after ``consumed_blocks`` training blocks (the held-out head not counted), as
        JSON-able data; ``LowBitTrainer`` saves it with each checkpoint."""
        consumed_blocks += self.skip_blocks
        usable = [s for s in self._snapshots if s[0] <= consumed_blocks]
        if not usable:  # older than every snapshot in memory: replay from the start
            return {"snapshot_block": 0, "source": None, "carry": [], "carry_mask": None,
                    "next_block": consumed_blocks, "block_size": self.block_size}
        n, source_state, carry, carry_mask = usable[-1]
        return {"snapshot_block": n, "source": source_state, "carry": carry, "carry_mask": carry_mask,
                "next_block": consumed_blocks, "block_size": self.block_size}

    def seek(self, state: dict) -> None:
        """Make the next iteration continue from a :meth:`position`."""
        if state.get("block_size") != self.block_size:
            raise ValueError(f"the checkpoint's data position was saved with block_size={state.get('block_size')}, "
                             f"this run has {self.block_size}")
        self._resume = (state["snapshot_block"], state["source"], state["carry"], state.get("carry_mask"),
                        state["next_block"])


class TokenFileBlocks(Dataset):
    """Blocks of ``block_size`` tokens from a directory (or one file) of pre-tokenized ``.npy`` or raw
    ``.bin`` files, memory-mapped. Files are concatenated in name order; a block never spans two files
    (each file's remainder is dropped), so block ``i`` is found by a binary search over file offsets."""

    def __init__(self, path: str, block_size: int, dtype: str = "uint16", blocks: range | None = None):
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {block_size}")
        if dtype not in TOKEN_FILE_DTYPES:
            raise DataFormatError(f"--token_dtype must be one of {', '.join(TOKEN_FILE_DTYPES)}, got {dtype!r}")
        if os.path.isdir(path):
            files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith((".bin", ".npy")))
            if not files:
                raise DataFormatError(f"--token_files {path}: no .bin or .npy files in the directory")
        elif os.path.isfile(path):
            files = [path]
        else:
            raise DataNotFoundError(f"--token_files {path!r}: no such file or directory")
        self.path, self.block_size, self.files, self.arrays = path, block_size, files, []
        for f in files:
            if f.endswith(".npy"):
                try:
                    a = np.load(f, mmap_mode="r")
                except ValueError as e:
                    raise DataFormatError(f"{f}: not a readable .npy file ({e})") from None
                if a.ndim != 1 or a.dtype.kind not in "iu":
                    raise DataFormatError(f"{f}: expected a 1-D integer array of token ids, got {a.dtype} {a.shape}")
            elif f.endswith(".bin"):
                item = np.dtype(TOKEN_FILE_DTYPES[dtype]).itemsize
                if os.path.getsize(f) % item:
                    raise DataFormatError(f"{f}: {os.path.getsize(f)} bytes is not a whole number of {dtype} tokens "
                                          "(check --token_dtype)")
                a = np.memmap(f, dtype=TOKEN_FILE_DTYPES[dtype], mode="r")
            else:
                raise DataFormatError(f"--token_files {f!r}: token files must end in .bin or .npy")
            self.arrays.append(a)
        counts = [len(a) // block_size for a in self.arrays]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
        total = self.starts[-1]
        if total == 0:
            raise DataFormatError(f"--token_files {path}: {sum(map(len, self.arrays))} tokens, fewer than one "
                                  f"block of block_size={block_size} per file")
        self.blocks = blocks if blocks is not None else range(total)
        self.n_tokens = sum(len(a) for a in self.arrays)

    def split(self, n_eval: int) -> tuple["TokenFileBlocks", "TokenFileBlocks"]:
        """(train, eval): the last ``n_eval`` blocks are held out."""
        if not 0 <= n_eval < len(self.blocks):
            raise DataFormatError(f"--token_files {self.path}: cannot hold out {n_eval} of {len(self.blocks)} blocks")
        cut = len(self.blocks) - n_eval
        a, b = (TokenFileBlocks.__new__(TokenFileBlocks) for _ in range(2))
        a.__dict__.update(self.__dict__, blocks=self.blocks[:cut])
        b.__dict__.update(self.__dict__, blocks=self.blocks[cut:])
        return a, b

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict:
        g = self.blocks[i]
        f = bisect.bisect_right(self.starts, g) - 1
        off = (g - self.starts[f]) * self.block_size
        ids = torch.from_numpy(np.asarray(self.arrays[f][off:off + self.block_size]).astype(np.int64))
        return _example(ids, None)  # token files hold no prompt/completion structure: every token is trained on


def write_token_file(path: str, ids, dtype: str = "uint16") -> None:
    """Write token ids as a raw ``.bin`` (or ``.npy``) file that :class:`TokenFileBlocks` reads; written to a
    temporary name and renamed, so a crash never leaves a truncated file."""
    arr = np.asarray(ids)
    np_dtype = TOKEN_FILE_DTYPES[dtype]
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np_dtype).max):
        raise ValueError(f"token ids {arr.min()}..{arr.max()} do not fit {dtype}")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        if path.endswith(".npy"):
            np.save(f, arr.astype(np_dtype))
        else:
            arr.astype(np_dtype).tofile(f)
    os.replace(tmp, path)
