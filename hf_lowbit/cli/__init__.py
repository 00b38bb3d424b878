"""Command lines. :mod:`.sft`: ``hf-lowbit-sft`` (also ``python scripts/sft.py``): fine-tuning and pre-training
with the recipes, from a local file, a Hub dataset, a stream or token files."""
