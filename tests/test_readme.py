"""Every number of the README's headline table is the number its record in docs/results/ holds (the table's last
column names the file and the record; a peer named in backticks is the record of that recipe in the same block)."""

import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW = re.compile(r"^\| (?P<what>[^|]+) \| (?P<regime>[^|]+) \| (?P<ratio>[^|]+) \| (?P<peer>[^|]+) \| (?P<memory>[^|]+) "
                 r"\| (?P<commit>[^|]+) \| \[(?P<label>[^\]]+)\]\((?P<path>[^)]+)\) \|$")
NUMBER = re.compile(r"(\d+\.\d\d)×")


def headline_rows() -> list[dict]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    table = text.split("## Headline results", 1)[1].split("\n## ", 1)[0]
    rows = [m.groupdict() for m in map(ROW.match, table.splitlines()) if m]
    assert len(rows) == sum(line.startswith("| ") for line in table.splitlines()) - 1, "a row the test cannot read"
    return rows


def find(path: str, selector: str, recipe: str | None = None) -> tuple[dict, dict]:
    """(the file's JSON, the record): ``block/recipe`` (``block/recipe@commit``, ``block/recipe@commit:run``) in a
    regimes file, ``recipe`` or ``recipe@gpus`` in a rows file; ``recipe`` replaces the selector's (a peer in the same
    block, run or GPU count)."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        data = json.load(f)
    if "records" in data:  # block/recipe, @commit where the file holds the block of more than one run, :run where
        block, _, name = selector.partition("/")  # more than one run measured the same commit
        name, _, commit = name.partition("@")
        commit, _, run = commit.partition(":")
        match = [r for r in data["records"] if r.get("block") == block and r.get("recipe") == (recipe or name)
                 and (not commit or r.get("commit") == commit) and (not run or r.get("run") == run)]
    else:
        name, _, gpus = selector.partition("@")
        match = [r for r in data["rows"] if r.get("recipe") == (recipe or name) and (not gpus or r["gpus"] == int(gpus))]
    assert len(match) == 1, (path, selector, recipe, len(match))
    return data, match[0]


def shown(cell: str) -> str | None:
    """The first ratio in a cell ("1.24×"), or None for "–"."""
    m = NUMBER.search(cell)
    assert m or cell.strip() == "–", cell
    return m.group(1) if m else None


def test_headline_numbers_are_the_records_numbers():
    rows = headline_rows()
    assert len(rows) >= 10
    for row in rows:
        where = f"README row {row['what']!r} ({row['regime']})"
        selector = row["label"].split(" ", 1)[1]
        data, rec = find(row["path"], selector)
        assert "error" not in rec, where
        ratio, memory = rec.get("vs_bf16", rec.get("vs_ref")), rec.get("mem_vs_bf16", rec.get("mem_vs_ref"))
        if shown(row["ratio"]) is not None:
            assert shown(row["ratio"]) == f"{ratio:.2f}", where
        if shown(row["memory"]) is not None:
            assert shown(row["memory"]) == f"{memory:.2f}", where
        peer = re.match(r"`(\w+)` (\d+\.\d\d)×(?: \(memory (\d+\.\d\d)×\))?$", row["peer"].strip())
        assert peer or row["peer"].strip() == "–", where
        if peer:
            _, other = find(row["path"], selector, recipe=peer.group(1))
            assert peer.group(2) == f"{other.get('vs_bf16', other.get('vs_ref')):.2f}", where
            if peer.group(3):
                assert peer.group(3) == f"{other.get('mem_vs_bf16', other.get('mem_vs_ref')):.2f}", where
        commit = rec.get("commit") or data["meta"]["commit"]
        cell = row["commit"].strip()
        if cell.startswith("≤ "):  # the run did not record its commit; the results were committed at this one
            assert "not recorded" in commit and cell[2:] in commit, where
        else:
            assert commit.startswith(cell), where
