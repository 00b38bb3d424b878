#!/usr/bin/env python
"""Packing throughput (tokens/s) and peak memory of the data paths, on a generated JSONL file.

    python benchmarks/bench_data.py --sizes_mb 64,1024 --arrow_sizes_mb 64,256,1024 --before_sizes_mb 64,256 \
        --json docs/results/bench_data_cpu.json --md docs/results/bench_data_cpu.md
    python benchmarks/bench_data.py --merge run1.json run2.json --json ... --md ...   # runs split in parts

Paths measured, each in a fresh subprocess (a cold ``datasets`` cache in a temporary directory):

- ``before``: what ``scripts/sft.py`` did until issue 17 (``data.load_records`` into Python lists,
  ``format_records``, ``data.pack`` into one in-memory tensor);
- ``arrow``: ``packing.load_raw`` + ``packing.tokenize`` (``Dataset.map``, ``--num_proc`` workers) +
  ``packing.packed_dataset`` (blocks over the memory-mapped token column), then every block read once;
- ``streaming``: ``load_raw(streaming=True)`` + ``packing.StreamingBlocks``, every block read once.

Memory: a sampler thread reads ``/proc/self/status`` every 0.1 s; ``peak_rss_anon_mib`` is the process's
own (anonymous) memory, ``peak_rss_mib`` adds file pages mapped in (the memory-mapped Arrow cache, which
the kernel can drop at will); ``children_peak_rss_mib`` is the largest ``map`` worker. The tokenizer is a
byte-level BPE (vocabulary 8192) trained here on the first 2 MB of the file. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.driver import error_cell, run_worker, write_results  # noqa: E402


def generate(path: str, size_mb: int, seed: int = 0) -> None:
    """JSONL of ``{"text": ...}`` records (~200-2000 characters of pseudo-words), ``size_mb`` MiB; written
    to a temporary name and renamed."""
    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = ["".join(rng.choice(letters[: rng.randint(6, 26)]) for _ in range(rng.randint(1, 9))) for _ in range(20000)]
    target = size_mb << 20
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        written = 0
        while written < target:
            n = rng.randint(30, 300)
            line = json.dumps({"text": " ".join(rng.choices(words, k=n)) + "."}) + "\n"
            f.write(line)
            written += len(line)
    os.replace(tmp, path)


def build_tokenizer(path: str, out_dir: str):
    """The byte-level BPE (vocabulary 8192) of benchmarks/corpus.py, trained on the file's first 2 MB, saved."""
    from benchmarks.corpus import build_bpe_tokenizer

    texts = []
    with open(path) as f:
        size = 0
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(line)
            if size > 2 << 20:
                break
    build_bpe_tokenizer(texts, 8192).save_pretrained(out_dir)


class MemorySampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak_anon = self.peak_rss = 0
        self.stop = False

    def run(self):
        while not self.stop:
            self.sample()
            time.sleep(0.1)

    def sample(self):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    self.peak_anon = max(self.peak_anon, int(line.split()[1]) * 1024)
                elif line.startswith("VmRSS:"):
                    self.peak_rss = max(self.peak_rss, int(line.split()[1]) * 1024)


def worker(method: str, path: str, tokenizer_dir: str, block_size: int, num_proc: int) -> dict:
    import datasets
    from transformers import AutoTokenizer

    from hf_lowbit import data
    from hf_lowbit.data import packing

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    sampler = MemorySampler()
    sampler.start()
    t0 = time.perf_counter()
    if method == "before":
        records = data.load_records(path)
        ds = data.pack(data.format_records(records, tokenizer, path), tokenizer, block_size)
        blocks, tokens = len(ds), ds.blocks.numel()
    elif method == "arrow":
        ds = packing.packed_dataset(packing.tokenize(packing.load_raw(path), tokenizer, packing.Locator(path),
                                                     num_proc=num_proc), block_size)
        blocks = tokens = 0
        for i in range(len(ds)):
            tokens += len(ds.block(i))
            blocks += 1
    elif method == "streaming":
        ds = packing.StreamingBlocks(packing.tokenize(packing.load_raw(path, streaming=True), tokenizer,
                                                      packing.Locator(path)), block_size)
        blocks = tokens = 0
        for item in ds:
            tokens += item["input_ids"].numel()
            blocks += 1
    else:
        raise SystemExit(f"unknown method {method!r}")
    seconds = time.perf_counter() - t0
    sampler.stop = True
    sampler.sample()
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {"method": method, "file_mib": round(os.path.getsize(path) / 2**20, 1), "blocks": blocks,
            "tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds),
            "peak_rss_anon_mib": round(sampler.peak_anon / 2**20, 1), "peak_rss_mib": round(sampler.peak_rss / 2**20, 1),
            "children_peak_rss_mib": round(children / 2**20, 1), "num_proc": num_proc if method == "arrow" else 1}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes_mb", default="64,1024", help="file sizes for the streaming path")
    p.add_argument("--arrow_sizes_mb", default="64,256,1024", help="file sizes for the arrow (map-style) path")
    p.add_argument("--before_sizes_mb", default="64,256", help="file sizes for the in-memory path (it grows with the file)")
    p.add_argument("--block_size", type=int, default=2048)
    p.add_argument("--num_proc", type=int, default=2)
    p.add_argument("--workdir", default=None, help="where the generated files go (default: a temporary directory)")
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge earlier runs' --json files into --json/--md")
    p.add_argument("--timeout", type=int, default=7200, help="seconds per path and size (its own process)")
    p.add_argument("--worker", nargs=2, metavar=("METHOD", "FILE"), help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(a.worker[0], a.worker[1], a.tokenizer, a.block_size, a.num_proc)))
        return
    if a.merge:
        merge(a.merge, a.json, a.md)
        return
    work = a.workdir or tempfile.mkdtemp(prefix="bench_data-")
    os.makedirs(work, exist_ok=True)
    sizes = [int(s) for s in a.sizes_mb.split(",") if s]
    before = [int(s) for s in a.before_sizes_mb.split(",") if s]
    arrow = [int(s) for s in a.arrow_sizes_mb.split(",") if s]
    rows = []
    tok_dir = os.path.join(work, "tokenizer")
    for size in sorted(set(sizes) | set(before) | set(arrow)):
        path = os.path.join(work, f"gen_{size}mb.jsonl")
        if not os.path.exists(path):
            generate(path, size)
        if not os.path.exists(tok_dir):
            build_tokenizer(path, tok_dir)
        for method in (["before"] if size in before else []) + (["arrow"] if size in arrow else []) + \
                (["streaming"] if size in sizes else []):
            with tempfile.TemporaryDirectory(dir=work) as cache:
                row = run_worker([sys.executable, os.path.abspath(__file__), "--worker", method, path, "--tokenizer",
                                  tok_dir, "--block_size", str(a.block_size), "--num_proc", str(a.num_proc)],
                                 {"method": method, "file_mib": size}, a.timeout,
                                 env={"HF_DATASETS_CACHE": cache, "PYTHONPATH": ROOT})
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} CPU cores (shared), "
                       f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM",
            "python": platform.python_version(), "block_size": a.block_size, "num_proc": a.num_proc,
            "date": time.strftime("%Y-%m-%d", time.gmtime())}
    write_table(rows, meta, a.json, a.md)


def write_table(rows: list[dict], meta: dict, json_path: str | None, md_path: str | None) -> None:
    table = ["| path | file MiB | tokens | tokens/s | peak RSS anon MiB | peak RSS MiB (incl. mapped files) | largest worker MiB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            table.append(f"| {r['method']} | {r['file_mib']} | {error_cell(r['error'])} | | | | |")
        else:
            table.append(f"| {r['method']} | {r['file_mib']} | {r['tokens']:,} | {r['tokens_per_s']:,} | "
                         f"{r['peak_rss_anon_mib']} | {r['peak_rss_mib']} | {r['children_peak_rss_mib']} |")
    write_results({"meta": meta, "rows": rows}, table,
                  f"Packing throughput and peak memory ({meta['machine']}, Python {meta['python']}, block_size "
                  f"{meta['block_size']}, {meta['date']}; `benchmarks/bench_data.py`)", json_path, md_path)


def merge(paths: list[str], json_path: str | None, md_path: str | None) -> None:
    """One table from several runs' JSON (runs split to fit a time budget), rows by method, then size."""
    rows, meta = [], None
    for p in paths:
        with open(p) as f:
            data = json.load(f)
        rows += data["rows"]
        meta = meta or data["meta"]
    order = {"before": 0, "arrow": 1, "streaming": 2}
    rows.sort(key=lambda r: (order.get(r["method"], 9), r["file_mib"]))
    write_table(rows, meta, json_path, md_path)


if __name__ == "__main__":
    main()
