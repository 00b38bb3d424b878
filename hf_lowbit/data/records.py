"""Data for supervised fine-tuning: loading records, chat/instruction formatting, splitting off a held-out share.

Packing the formatted texts into fixed blocks is :mod:`hf_lowbit.data.packing`'s. Also here: the embedded default
task (arithmetic Q/A, generated, no download) with its character tokenizer and accuracy check.
"""

from __future__ import annotations

import json
import os
import random
from typing import Iterator

import torch

LOCAL_FORMATS = (".json", ".jsonl", ".parquet")
RECORD_FORMATS = ("'text'", "'messages' (list of {role, content})", "'prompt' + 'completion'",
                  "'instruction' (+ 'input') + 'output' or 'response'")


class DataFormatError(ValueError):
    """A data file or record that cannot be used; the message names the file and the line or record."""


class DataNotFoundError(DataFormatError, FileNotFoundError):
    """``--dataset`` names no file and no loadable dataset."""


# --------------------------------------------------------------------------------------- loading
def load_records(dataset: str, split: str = "train") -> list[dict]:
    """Records from a local .json/.jsonl/.parquet file, or a dataset on the Hub (through ``datasets``)."""
    if dataset.endswith(LOCAL_FORMATS) or os.path.exists(dataset):
        if not os.path.isfile(dataset):
            raise DataNotFoundError(f"--dataset {dataset!r}: no such file")
        if dataset.endswith(".jsonl"):
            return _read_jsonl(dataset)
        if dataset.endswith(".json"):
            return _read_json(dataset)
        if dataset.endswith(".parquet"):
            import datasets

            try:
                return list(datasets.load_dataset("parquet", data_files=dataset, split="train"))
            except Exception as e:  # pyarrow's errors do not name the file
                raise DataFormatError(f"{dataset}: not a readable parquet file ({e})") from e
        raise DataFormatError(f"--dataset {dataset!r}: local files must end in {', '.join(LOCAL_FORMATS)}")
    import datasets

    return list(datasets.load_dataset(dataset, split=split))


def iter_jsonl(path: str) -> Iterator[dict]:
    """The records of a JSON Lines file; the first line that is not a JSON object raises a
    ``DataFormatError`` naming the file and the line."""
    with open(path, encoding="utf-8", errors="strict") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataFormatError(f"{path}, line {lineno}: invalid JSON ({e.msg} at column {e.colno}); "
                                      "each line must be one JSON object") from None
            if not isinstance(record, dict):
                raise DataFormatError(f"{path}, line {lineno}: expected a JSON object, got {type(record).__name__}")
            yield record


def _read_jsonl(path: str) -> list[dict]:
    return list(iter_jsonl(path))


def _read_json(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise DataFormatError(f"{path}, line {e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DataFormatError(f"{path}: expected a list of records (or {{'data': [...]}})")
    for i, record in enumerate(data):
        if not isinstance(record, dict):
            raise DataFormatError(f"{path}, record {i}: expected a JSON object, got {type(record).__name__}")
    return data


# ------------------------------------------------------------------------------------ formatting
Segment = tuple[str, bool]  # (text, trainable): the loss covers the tokens of trainable segments only


def format_segments(record: dict, tokenizer, where: str = "record") -> list[Segment]:
    """A record in any of the supported formats as consecutive ``(text, trainable)`` segments whose texts
    join to the training text: ``text`` is all trainable; a ``prompt`` and an instruction (with its
    ``### Response:`` header) are not, their ``completion``/``output``/``response`` is; in a chat
    (``messages``, or ``prompt``+``completion`` given as lists of messages) the assistant turns are, the
    rest is not."""

    def text(key):
        value = record.get(key)
        if not isinstance(value, str):
            raise DataFormatError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
        return value

    if "text" in record:
        return [(text("text"), True)]
    if "messages" in record:
        return _chat_segments(_messages(record["messages"], "messages", where), tokenizer, where)
    if "prompt" in record and "completion" in record:
        if isinstance(record["prompt"], list) and isinstance(record["completion"], list):  # TRL's conversational form
            prompt = _messages(record["prompt"], "prompt", where)
            return _chat_segments(prompt + _messages(record["completion"], "completion", where), tokenizer, where,
                                  first_trainable=len(prompt))
        return [(text("prompt"), False), (text("completion"), True)]
    if "instruction" in record and ("output" in record or "response" in record):
        answer = text("output" if "output" in record else "response")
        context = f"\n\n### Input:\n{text('input')}" if record.get("input") else ""
        return [(f"### Instruction:\n{text('instruction')}{context}\n\n### Response:\n", False), (answer, True)]
    raise DataFormatError(f"{where}: unrecognised record with keys {sorted(record)}; expected one of "
                          + "; ".join(RECORD_FORMATS))


def format_record(record: dict, tokenizer, where: str = "record") -> str:
    """One training text from a record in any of the supported formats."""
    return "".join(t for t, _ in format_segments(record, tokenizer, where))


def _messages(messages, key: str, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise DataFormatError(f"{where}: {key!r} must be a non-empty list of {{'role': str, 'content': str}}")
    return messages


def _chat_segments(messages: list[dict], tokenizer, where: str, first_trainable: int = 0) -> list[Segment]:
    """The conversation rendered with the tokenizer's chat template (or ``<|role|>`` headers without one),
    assistant turns from ``first_trainable`` on trainable. Works with any template, ``{% generation %}``
    markers or not: each assistant turn's span is found by rendering the conversation up to it."""
    trainable = lambda i: messages[i]["role"] == "assistant" and i >= first_trainable  # noqa: E731
    if not getattr(tokenizer, "chat_template", None):
        out = []
        for i, m in enumerate(messages):
            out += [(f"<|{m['role']}|>\n", False), (f"{m['content']}\n", trainable(i))]
        return out
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    out, pos = [], 0
    for i in range(len(messages)):
        if not trainable(i):
            continue
        prompt, completion = _render_turn(messages, i, tokenizer)
        start, end = len(prompt), len(prompt) + len(completion)
        if start < pos or full[:end] != prompt + completion:
            raise DataFormatError(f"{where}: the chat template does not render the conversation up to message {i} "
                                  "as a prefix of the whole, so its assistant tokens cannot be told apart; "
                                  "train on every token with --completion_only_loss False")
        out += [(full[pos:start], False), (full[start:end], True)]
        pos = end
    out.append((full[pos:], False))
    return [s for s in out if s[0]]


def _render_turn(messages: list[dict], i: int, tokenizer) -> tuple[str, str]:
    """(the rendered conversation before assistant message ``i``, generation prompt included; that message)."""
    render = lambda m, **kw: tokenizer.apply_chat_template(m, tokenize=False, **kw)  # noqa: E731
    if i > 0 and messages[i - 1]["role"] in ("user", "tool", "assistant"):
        try:
            from trl.data_utils import apply_chat_template
        except ImportError:  # trl is optional: the same split, for a prompt that ends with a user turn
            apply_chat_template = None
        if apply_chat_template is not None:
            # TRL: the prompt with the generation prompt (or the final message continued), cut to the common
            # prefix with the rendered prompt+completion (templates such as DeepSeek-R1 differ there)
            out = apply_chat_template({"prompt": messages[:i], "completion": [messages[i]]}, tokenizer)
            return out["prompt"], out["completion"]
        if messages[i - 1]["role"] != "assistant":
            prompt, whole = render(messages[:i], add_generation_prompt=True), render(messages[: i + 1])
            prompt = os.path.commonprefix([prompt, whole])
            return prompt, whole[len(prompt):]
    prompt = render(messages[:i]) if i else ""
    return prompt, render(messages[: i + 1])[len(prompt):]


def format_records(records: list[dict], tokenizer, source: str) -> list[str]:
    return [format_record(r, tokenizer, where=f"{source}, record {i}") for i, r in enumerate(records)]


def split_records(records: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """Shuffle and split off ``eval_fraction`` of the records (at least one, if the fraction is > 0)."""
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    records = list(records)
    random.Random(seed).shuffle(records)
    n_eval = max(1, round(len(records) * eval_fraction)) if eval_fraction > 0 else 0
    return records[n_eval:], records[:n_eval]


# ----------------------------------------------------------------------- the embedded default task
ARITHMETIC_CHARS = list("0123456789+=")


def arithmetic_records(n_train: int, n_eval: int, seed: int = 0, max_operand: int = 99) -> tuple[list, list]:
    """Addition problems ``{"prompt": "12+34=", "completion": "46"}``; eval pairs never appear in training."""
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    if n_eval >= len(pairs):
        raise ValueError(f"n_eval={n_eval} leaves no training problems (there are {len(pairs)})")
    rng = random.Random(seed)
    rng.shuffle(pairs)
    held_out, pool = pairs[:n_eval], pairs[n_eval:]
    make = lambda a, b: {"prompt": f"{a}+{b}=", "completion": str(a + b)}
    return [make(*rng.choice(pool)) for _ in range(n_train)], [make(a, b) for a, b in held_out]


def build_char_tokenizer(chars: list[str]):
    """A character-level fast tokenizer (built locally: nothing is downloaded)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


@torch.no_grad()
def completion_accuracy(model, tokenizer, records: list[dict], max_new_tokens: int = 8,
                        batch_size: int = 64) -> float:
    """Share of records whose greedy completion of ``prompt`` equals ``completion`` exactly."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    by_len: dict[int, list[tuple[list[int], dict]]] = {}
    for r in records:  # same-length prompts batch without padding
        prompt = tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
        by_len.setdefault(len(prompt), []).append((prompt, r))
    correct = 0
    for group in by_len.values():
        for i in range(0, len(group), batch_size):
            prompts, chunk = zip(*group[i: i + batch_size])
            ids = torch.tensor(prompts, device=device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
            for r, row in zip(chunk, out[:, ids.shape[1]:]):
                correct += tokenizer.decode(row, skip_special_tokens=True).strip() == r["completion"]
    model.train(was_training)
    return correct / max(1, len(records))
