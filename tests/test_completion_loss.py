"""Completion-only loss: prompt (and non-assistant chat) tokens get label -100 in every record format, the
same in the Arrow and streaming paths and across block boundaries; --completion_only_loss False trains on all."""

import json
import string

import pytest
import torch

datasets = pytest.importorskip("datasets")  # the GPU image has none; CI installs it

from hf_lowbit import packing
from hf_lowbit.data import build_char_tokenizer, format_record
from hf_lowbit.cli.sft import parse_args



def _printable_tokenizer():
    """One token per printable character, newlines included (the embedded tokenizer's "." skips them)."""
    from tokenizers import Regex, pre_tokenizers

    tok = build_char_tokenizer(list(dict.fromkeys(string.printable)))
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    return tok


TOK, CHAT = _printable_tokenizer(), _printable_tokenizer()
CHAT.chat_template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }};{% endfor %}"
                      "{% if add_generation_prompt %}[assistant]{% endif %}")
CHAT_TURNS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1?"},
              {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": "4"}]

# (record, tokenizer, the text of its trainable tokens; EOS is trained on too)
CASES = {
    "text": ({"text": "12+3=15"}, TOK, "12+3=15"),
    "prompt_completion": ({"prompt": "12+3=", "completion": "15"}, TOK, "15"),
    "instruction": ({"instruction": "add", "input": "1 2", "output": "3"}, TOK, "3"),
    "response": ({"instruction": "add 1 2", "response": "3"}, TOK, "3"),
    "chat_no_template": ({"messages": CHAT_TURNS}, TOK, "2\n4\n"),
    "chat_template": ({"messages": CHAT_TURNS}, CHAT, "2;4;"),  # the assistant contents and their end marks
    "trl_conversational": ({"prompt": CHAT_TURNS[:4], "completion": CHAT_TURNS[4:]}, CHAT, "4;"),
}


def _tokenized(records, tok, completion_only=True):
    return packing.tokenize(datasets.Dataset.from_list(records), tok, str, completion_only=completion_only)


@pytest.mark.parametrize("name", list(CASES))
def test_only_the_completion_is_trainable(name):
    record, tok, completion = CASES[name]
    row = _tokenized([record], tok)[0]
    ids, mask = torch.tensor(row["input_ids"]), torch.tensor(row["completion_mask"], dtype=torch.bool)
    assert ids[-1] == tok.eos_token_id and mask[-1]
    assert tok.decode(ids[:-1][mask[:-1]]) == completion
    assert tok.decode(ids[:-1]) == format_record(record, tok)  # masking does not change the tokens
    if name != "text":
        assert not mask[0]
    off = _tokenized([record], tok, completion_only=False)
    assert off.column_names == ["input_ids"] and off[0]["input_ids"] == row["input_ids"]


def _records(n=120):
    return [{"prompt": f"{i}+{i % 7}=", "completion": str(i + i % 7)} if i % 3 else {"text": f"{i}+0={i}"}
            for i in range(n)]


def _file_tokenized(tmp_path, completion_only=True):  # a file: its reader unifies the records' keys
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _records()) + "\n")
    return packing.tokenize(packing.load_raw(str(path)), TOK, packing.Locator(str(path)),
                            completion_only=completion_only)


def test_blocks_keep_shape_and_labels_follow_masks_across_boundaries(tmp_path):
    tokenized = _file_tokenized(tmp_path)
    ids = [t for r in tokenized["input_ids"] for t in r]
    mask = [m for r in tokenized["completion_mask"] for m in r]
    blocks = packing.packed_dataset(tokenized, 16)
    assert len(blocks) == len(ids) // 16
    for i in range(len(blocks)):
        b = blocks[i]
        assert b["input_ids"].shape == b["labels"].shape == (16,)
        want = [t if m else -100 for t, m in zip(ids[16 * i:16 * i + 16], mask[16 * i:16 * i + 16])]
        assert b["labels"].tolist() == want
    assert -100 in blocks[0]["labels"].tolist()
    off = packing.packed_dataset(_file_tokenized(tmp_path, completion_only=False), 16)
    assert all(torch.equal(off[i]["labels"], off[i]["input_ids"]) and torch.equal(off[i]["input_ids"],
                                                                                  blocks[i]["input_ids"])
               for i in range(len(off)))


def test_streaming_gives_the_arrow_blocks_and_labels_and_resumes_them(tmp_path):
    arrow = packing.packed_dataset(_file_tokenized(tmp_path), 16)
    path = tmp_path / "d.jsonl"

    def stream():
        return packing.StreamingBlocks(packing.tokenize(packing.load_raw(str(path), streaming=True), TOK,
                                                        packing.Locator(str(path)), completion_only=True), 16,
                                       snapshot_every=3)

    s = stream()
    streamed = list(s)
    assert len(streamed) == len(arrow)
    for i, b in enumerate(streamed):
        assert torch.equal(b["input_ids"], arrow[i]["input_ids"]) and torch.equal(b["labels"], arrow[i]["labels"])
    state = json.loads(json.dumps(s.position(7)))  # as saved in a checkpoint
    assert len(state["carry_mask"]) == len(state["carry"]) > 0  # a block boundary inside a record: its mask travels
    resumed = stream()
    resumed.seek(state)
    rest = list(resumed)
    assert len(rest) == len(arrow) - 7
    assert all(torch.equal(b["input_ids"], arrow[7 + i]["input_ids"]) and torch.equal(b["labels"], arrow[7 + i]["labels"])
               for i, b in enumerate(rest))


def test_flag_defaults():
    assert parse_args(["--model_name_or_path", "m", "--dataset", "d.jsonl"])[1].completion_only_loss is True
    assert parse_args(["--model_name_or_path", "m", "--dataset", "d.jsonl", "--completion_only_loss", "False"]
                      )[1].completion_only_loss is False
    assert parse_args([])[1].completion_only_loss is False  # the embedded default trains on all of "a+b=c"
    assert parse_args(["--completion_only_loss", "True"])[1].completion_only_loss is True


def test_sft_run_computes_the_loss_on_completions_only(tmp_path):
    from conftest import ARITH_TOKENIZER, save_tiny_model

    from hf_lowbit.cli.sft import main

    tok = ARITH_TOKENIZER
    model_dir = save_tiny_model(tmp_path / "model", tok, 32, seed=0)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{i}+{i}=", "completion": str(2 * i)}) for i in range(300)))

    def run(out, *extra):
        return main(["--model_name_or_path", str(model_dir), "--dataset", str(data), "--output_dir", str(tmp_path / out),
                     "--report_to", "none", "--max_steps", "2", "--block_size", "32", "--logging_steps", "1",
                     "--per_device_train_batch_size", "4", "--save_strategy", "no", "--disable_tqdm", "True",
                     "--seed", "0", *extra])

    from hf_lowbit.cli.sft import build_data

    data_args = parse_args(["--model_name_or_path", str(model_dir), "--dataset", str(data), "--block_size", "32"])[1]
    train = build_data(data_args, tok, 0, embedded=False)[0]  # what the Trainer gets: no '+' or '=' in the loss
    labels = torch.stack([train[i]["labels"] for i in range(len(train))])
    kept = set(labels[labels != -100].tolist())
    assert (labels == -100).any() and not kept & set(tok.convert_tokens_to_ids(["+", "="]))
    assert tok.eos_token_id in kept and tok.convert_tokens_to_ids("4") in kept
    masked, everything = run("masked"), run("all", "--completion_only_loss", "False")
    assert len(masked["train_losses"]) == 2 and all(x == x for x in masked["train_losses"])  # trains, no NaN
    # the same model, blocks and order: only the labels differ, so the first loss does
    assert abs(masked["train_losses"][0] - everything["train_losses"][0]) > 1e-3, (masked, everything)
