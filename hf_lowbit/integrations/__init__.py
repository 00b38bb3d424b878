"""Integrations with the libraries around a prepared model: one module each, none imported here (each is
loaded by what uses it).

* :mod:`.distributed`: FSDP2: which parameters ``fully_shard`` can shard (quantized bases' integer codes, the float
  carrier for torch < 2.13), the low-bit all-gather switched on, a full copy of a sharded model for the QAT export;
  DeepSpeed: the ZeRO stage and what ZeRO-3 refuses.
* :mod:`.liger`: Liger Kernel (``use_liger_kernel``) beside the recipes: what each owns, the LM-head conflict.
* :mod:`.throughput`: tokens/s and MFU for the Trainer's logs.

They sit above the recipes and the arguments (they take a prepared model and ``LowBitTrainingArguments``) and
below the trainer, which calls them.
"""
