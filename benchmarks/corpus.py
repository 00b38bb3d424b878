"""Real text for the benchmarks, shipped with Python: nothing is downloaded.

:func:`python_docs_corpus` (pydoc topics + standard-library docstrings), :func:`build_bpe_tokenizer` (a byte-level
BPE trained on the spot) and :func:`corpus_blocks` (both, packed into token blocks), used by
``benchmark_quality.py``, ``eval_qat.py``, ``benchmark_seed_table.py`` and (the tokenizer) ``bench_data.py``.
"""

from __future__ import annotations

import os


def _docstrings(root, min_chars: int, skip: set[str]):
    """Module, class and function docstrings of the ``*.py`` files under ``root`` (a directory, or one file;
    parsed, never imported), one file after another: a caller that needs only the first few stops the parsing."""
    import ast

    for path in [root] if root.is_file() else sorted(root.rglob("*.py")):
        if root.is_dir() and skip & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= min_chars:
                    yield doc


def package_sources(packages: tuple[str, ...]) -> list[list]:
    """The source paths of each installed package: its directories (namespace packages may have several), or
    the one file of a single-module package. ``ValueError`` naming the first that is not installed."""
    import importlib.util
    from pathlib import Path

    out = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None:
            raise ValueError(f"package {name!r} is not installed")
        if spec.submodule_search_locations:
            out.append([Path(p) for p in spec.submodule_search_locations])
        elif spec.origin and spec.origin.endswith(".py"):
            out.append([Path(spec.origin)])
        else:
            raise ValueError(f"package {name!r} has no Python sources to read (origin {spec.origin!r})")
    return out


def python_docs_corpus(min_chars: int = 200, packages: tuple[str, ...] = (), max_docs: int = 0) -> list[str]:
    """English prose every CPython installation ships: the ``pydoc`` topic pages plus the module,
    class and function docstrings of the standard library (read with ``ast``; nothing is imported
    or downloaded). Deterministic for a given Python version; tests and ``idlelib`` are left out.

    ``packages``: also the docstrings of these installed packages (e.g. ``("torch", "transformers")``: ~10 MB
    more, for runs longer than the ~0.46M tokens of the standard library allow without repeating it), each
    once (libraries repeat argument docs verbatim); deterministic for given package versions. A package that
    is not installed is an error: a run must not silently train on less text than asked.

    ``max_docs``: only the first ``max_docs`` of those documents (the same ones, in the same order), parsing no
    file after the one that completes them.
    """
    import itertools
    import sysconfig
    from pathlib import Path

    import pydoc_data.topics

    sources = package_sources(packages)  # a name that is not installed fails before the parsing
    docs = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    skip = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "ensurepip"}

    def parsed():
        yield from _docstrings(Path(sysconfig.get_paths()["stdlib"]), min_chars, skip)
        for paths in sources:
            seen = set()  # each package's docstrings once, in the order first found
            for d in (d for p in paths for d in _docstrings(p, min_chars, {"test", "tests", "testing"})):
                if d not in seen:
                    seen.add(d)
                    yield d

    if max_docs:
        return (docs + list(itertools.islice(parsed(), max(0, max_docs - len(docs)))))[:max_docs]
    return docs + list(parsed())


def build_bpe_tokenizer(texts: list[str], vocab_size: int = 4096):
    """A byte-level BPE tokenizer trained here on ``texts`` (no download), with ``</s>`` as EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")


def corpus_blocks(seq: int, vocab: int, *, eval_fraction: float | None = 0.1, seed: int = 0, max_docs: int = 0,
                  packages: tuple[str, ...] = (), cache_dir: str | None = None):
    """The corpus (its first ``max_docs`` documents, if given) in ``seq``-token blocks of a BPE of ``vocab`` tokens
    trained here: ``(tokenizer, train blocks, held-out blocks, its record for a result's meta)``. ``eval_fraction``
    of the documents is held out (split by ``seed``) before the tokenizer is trained on the rest; None: every
    document, in order, trains the tokenizer and fills the train blocks, and nothing is held out.

    ``cache_dir``: keep the result there (one subdirectory per set of arguments) and read it back next time. With
    packages the build parses thousands of files and trains a BPE on ~10 MB: ~7 minutes on a 2-core machine,
    device time when it runs on a lent GPU. A cache built elsewhere is the corpus of *that* machine's package
    versions: its record (``packages``, ``built_on``) says which."""
    if cache_dir:
        key = _cache_key(seq, vocab, eval_fraction, seed, max_docs, packages)
        hit = _load_cached(os.path.join(cache_dir, key))
        if hit is not None:
            return hit
    out = _build_blocks(seq, vocab, eval_fraction, seed, max_docs, packages)
    if cache_dir:
        _save_cached(os.path.join(cache_dir, key), *out)
    return out


def _cache_key(*args) -> str:
    """The arguments only, not the machine: a cache built on the CPU machine (Python 3.11) must be found on the
    GPU machine (3.12); which Python and packages built it is in the entry's record (``built_on``, ``packages``)."""
    import hashlib
    import json

    blob = json.dumps(list(args), default=list)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _save_cached(path: str, tok, train, held_out, info) -> None:
    """Written into a temporary sibling and renamed: an interrupted save leaves no half-written entry."""
    import json
    import shutil
    import tempfile

    import torch

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(path) or ".", prefix=".tmp-")
    try:
        small = torch.int16 if len(tok) <= 32767 else torch.int32  # ids in 2 bytes: a cache small enough to carry
        torch.save({"train": train.to(small), "held_out": None if held_out is None else held_out.to(small)},
                   os.path.join(tmp, "blocks.pt"))
        tok.save_pretrained(os.path.join(tmp, "tokenizer"))
        with open(os.path.join(tmp, "info.json"), "w") as f:
            json.dump(info, f)
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _load_cached(path: str):
    import json

    import torch
    from transformers import PreTrainedTokenizerFast

    if not os.path.isfile(os.path.join(path, "info.json")):
        return None
    blocks = torch.load(os.path.join(path, "blocks.pt"), weights_only=True)
    with open(os.path.join(path, "info.json")) as f:
        info = json.load(f)
    info["cache"] = path
    held_out = blocks["held_out"]
    return (PreTrainedTokenizerFast.from_pretrained(os.path.join(path, "tokenizer")), blocks["train"].long(),
            None if held_out is None else held_out.long(), info)


def _build_blocks(seq: int, vocab: int, eval_fraction: float | None, seed: int, max_docs: int,
                  packages: tuple[str, ...]):
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from hf_lowbit.data import pack, split_records

    docs = python_docs_corpus(packages=packages, max_docs=max_docs)
    train_docs, eval_docs = (docs, []) if eval_fraction is None else split_records(docs, eval_fraction, seed)
    tok = build_bpe_tokenizer(train_docs, vocab)
    train, held_out = pack(train_docs, tok, seq).blocks, pack(eval_docs, tok, seq).blocks if eval_docs else None

    def installed(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "?"

    info = {"documents": len(docs), "train_tokens": train.numel(),
            "eval_tokens": 0 if held_out is None else held_out.numel(), "chars": sum(map(len, docs)),
            "packages": {name: installed(name) for name in packages},
            "built_on": f"{platform.node()} (Python {platform.python_version()})"}
    return tok, train, held_out, info
