"""hf_lowbit.data.packing: the datasets-backed, streaming and pre-tokenized data paths agree with the
in-memory packing, errors name file and line, and a streaming run resumes where its checkpoint was."""

import json
import os

import numpy as np
import pytest
import torch

from hf_lowbit import packing
from hf_lowbit.data import (ARITHMETIC_CHARS, DataFormatError, build_char_tokenizer, format_records, load_records,
                            pack)
from conftest import save_tiny_model

TOK = build_char_tokenizer(ARITHMETIC_CHARS)


def _jsonl(path, n=300, extra=()):
    lines = [json.dumps({"text": f"{i}+{i}={2 * i}"}) for i in range(n)]
    lines[n // 2: n // 2] = [""]  # a blank line: no record, but it counts as a line
    path.write_text("\n".join(lines + list(extra)) + "\n")
    return str(path)


def _stream(path, block=16, **kw):
    return packing.StreamingBlocks(packing.tokenize(packing.load_raw(path, streaming=True), TOK,
                                                    packing.Locator(path)), block, **kw)


def test_three_paths_pack_the_same_blocks(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl")
    old = pack(format_records(load_records(path), TOK, path), TOK, 16).blocks
    arrow = packing.packed_dataset(packing.tokenize(packing.load_raw(path), TOK, packing.Locator(path)), 16)
    streamed = torch.stack([b["input_ids"] for b in _stream(path)])
    assert len(arrow) == old.shape[0] and torch.equal(streamed, old)
    assert all(torch.equal(arrow[i]["input_ids"], old[i]) and torch.equal(arrow[i]["labels"], old[i])
               for i in range(len(arrow)))


def test_tokenize_with_workers_and_split_keeps_blocks_whole(tmp_path):
    import datasets

    records = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(2500)]
    tok = packing.tokenize(datasets.Dataset.from_list(records), TOK, str, num_proc=2)
    parts = tok.train_test_split(test_size=100, seed=0)
    train = packing.packed_dataset(parts["train"], 32)
    assert len(train) == sum(len(x) for x in parts["train"]["input_ids"]) // 32
    assert train[len(train) - 1]["input_ids"].shape == (32,) and train[0]["input_ids"].dtype == torch.long


def test_record_errors_name_the_line_in_every_path(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", extra=[json.dumps({"question": "?"})])  # 300 records + 1 blank line
    with pytest.raises(DataFormatError, match=r"d.jsonl, line 302: unrecognised record with keys \['question'\]"):
        packing.tokenize(packing.load_raw(path), TOK, packing.Locator(path))
    with pytest.raises(DataFormatError, match=r"d.jsonl, line 302: unrecognised record"):
        list(_stream(path))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(DataFormatError, match=r"bad.jsonl, line 2: invalid JSON") as e:
        packing.load_raw(str(bad))
    assert e.value.__cause__ is None and e.value.__context__ is None or e.value.__suppress_context__
    with pytest.raises(DataFormatError, match=r"bad.jsonl, line 2: invalid JSON"):
        list(_stream(str(bad)))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        packing.load_raw(str(tmp_path / "missing.jsonl"))


def test_streaming_resumes_exactly_from_a_position(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl")
    full = [b["input_ids"] for b in _stream(path)]
    for consumed in (0, 7, 23, len(full) - 1):
        first = _stream(path, snapshot_every=5)
        it = iter(first)
        for _ in range(min(consumed + 3, len(full))):  # a DataLoader runs ahead of what training consumed
            next(it)
        position = json.loads(json.dumps(first.position(consumed)))  # saved as JSON with the checkpoint
        again = _stream(path, snapshot_every=5)
        again.seek(position)
        rest = [b["input_ids"] for b in again]
        assert len(rest) == len(full) - consumed and all(torch.equal(a, b) for a, b in zip(rest, full[consumed:]))


def test_streaming_head_is_held_out(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl")
    s = _stream(path)
    head = s.head(3)
    s.skip_blocks = 3
    full = [b["input_ids"] for b in _stream(path)]
    assert all(torch.equal(h["input_ids"], f) for h, f in zip(head, full[:3]))
    assert torch.equal(next(iter(s))["input_ids"], full[3])


def test_token_files_bin_and_npy(tmp_path):
    d = tmp_path / "tokens"
    d.mkdir()
    a, b = np.arange(100) % 16, (np.arange(70) + 3) % 16
    packing.write_token_file(str(d / "000.bin"), a, "uint16")
    packing.write_token_file(str(d / "001.npy"), b, "uint32")
    blocks = packing.TokenFileBlocks(str(d), 16, "uint16")
    assert len(blocks) == 100 // 16 + 70 // 16  # a block never spans two files
    assert blocks[0]["input_ids"].tolist() == a[:16].tolist()
    assert blocks[6]["input_ids"].tolist() == b[:16].tolist() and blocks[6]["input_ids"].dtype == torch.long
    train, held = blocks.split(2)
    assert len(train) == len(blocks) - 2 and held[1]["input_ids"].tolist() == b[48:64].tolist()
    (d / "002.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(DataFormatError, match=r"002.bin: 3 bytes is not a whole number of uint16 tokens"):
        packing.TokenFileBlocks(str(d), 16, "uint16")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        packing.TokenFileBlocks(str(tmp_path / "nowhere"), 16)
    assert not [f for f in os.listdir(d) if ".tmp-" in f]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    d = save_tiny_model(tmp_path_factory.mktemp("model"), TOK, 16, seed=0)
    return str(d)


def _sft(model_dir, out, *extra):
    from hf_lowbit.cli.sft import main

    return main(["--model_name_or_path", model_dir, "--output_dir", str(out), "--report_to", "none",
                 "--block_size", "16", "--per_device_train_batch_size", "4", "--logging_steps", "1",
                 "--learning_rate", "1e-2", "--disable_tqdm", "True", "--seed", "0", *extra])


def test_streaming_run_resumes_where_its_checkpoint_was(tmp_path, tiny_model_dir):
    """A streaming run stopped after its step-3 checkpoint and resumed trains steps 4-6 on the same blocks,
    with the same losses, as the run that never stopped (the data position is in the checkpoint)."""
    path = _jsonl(tmp_path / "d.jsonl", n=400)
    common = ["--dataset", path, "--streaming", "--max_steps", "6", "--save_steps", "3", "--eval_blocks", "2"]
    straight = _sft(tiny_model_dir, tmp_path / "a", *common)
    assert os.path.exists(tmp_path / "a" / "checkpoint-3" / "hf_lowbit_data_state.json")
    resumed = _sft(tiny_model_dir, tmp_path / "a", *common, "--resume_from_checkpoint", str(tmp_path / "a" / "checkpoint-3"))
    assert len(straight["train_losses"]) == 6 and len(resumed["train_losses"]) == 6  # 3 from the checkpoint's log
    assert resumed["train_losses"][3:] == pytest.approx(straight["train_losses"][3:], abs=1e-4)
    assert straight["train_blocks"] == 24


def test_token_files_run(tmp_path, tiny_model_dir):
    packing.write_token_file(str(tmp_path / "t.bin"), np.random.default_rng(0).integers(0, len(TOK), 4000), "uint16")
    metrics = _sft(tiny_model_dir, tmp_path / "o", "--token_files", str(tmp_path / "t.bin"), "--max_steps", "2",
                   "--save_strategy", "no")
    assert metrics["train_blocks"] == 250 - 12 and metrics["eval_loss"] > 0  # 5% of 250 blocks held out
