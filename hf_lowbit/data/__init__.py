"""The data path of ``hf-lowbit-sft``: records in, fixed-length token blocks out (docs/data.md).

* :mod:`.records`: reading JSON / JSONL / parquet / Hub records, formatting them (text, chat, prompt +
  completion, instruction), and the embedded default task (2-digit addition).
* :mod:`.packing`: texts into blocks: the ``datasets``-backed paths (Arrow blocks without a copy, streaming with a
  resumable position, memory-mapped token files) and, for a list of texts in memory, :func:`pack`.

Imports nothing else of the package: the CLI puts it together with the trainer.
"""

from .packing import PackedDataset, pack
from .records import (ARITHMETIC_CHARS, LOCAL_FORMATS, RECORD_FORMATS, DataFormatError, DataNotFoundError,
                      arithmetic_records, build_char_tokenizer, completion_accuracy, format_record, format_records,
                      format_segments, iter_jsonl, load_records, split_records)

__all__ = ["ARITHMETIC_CHARS", "LOCAL_FORMATS", "RECORD_FORMATS", "DataFormatError", "DataNotFoundError",
           "PackedDataset", "arithmetic_records", "build_char_tokenizer", "completion_accuracy", "format_record",
           "format_records", "format_segments", "iter_jsonl", "load_records", "pack", "split_records"]
