"""Writes that a process killed at any moment (SIGKILL included) leaves whole.

Everything is written under a name starting with ``.tmp-`` (incomplete by its name; transformers'
``get_last_checkpoint`` matches only ``checkpoint-N``) and moved into place with renames, which are atomic
within a file system:

* a whole directory (a ``checkpoint-N``, a ``save_quantized`` export) is staged beside its target and swapped
  in by :func:`replace_dir`: the target is always the complete old or the complete new directory, or absent
  between the two renames where the OS has no atomic exchange;
* a model saved into a directory that holds other things (``Trainer.save_model(output_dir)`` beside the run's
  checkpoints) is staged in ``<dir>/.tmp-model`` and its files moved in by :func:`publish_files`, the file that
  makes a directory a model to transformers (``config.json``; ``adapter_config.json`` for PEFT) last and the
  previous one removed first: a directory with that file holds a whole model, one without it is not a model
  (``from_pretrained`` refuses it) and keeps the ``.tmp-model`` that names the interrupted save.

A later save into the same place first removes what an interrupted one left (:func:`clear`). One writer per
target at a time, as for any Trainer output directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil

TMP = ".tmp-"
MODEL_STAGING = TMP + "model"  # inside the directory save_model writes to
# files that make a directory loadable by from_pretrained / PeftModel.from_pretrained: published last
COMMIT_FILES = ("config.json", "adapter_config.json")
# weight files of an earlier save that the new one does not overwrite (other shard counts) would be read
# with the new config (a stale index): removed before the commit file goes in
_WEIGHTS = re.compile(r"^(model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")


def staging_dir(target: str) -> str:
    """Where a directory destined for ``target`` is written first: ``.tmp-<name>`` beside it."""
    target = os.path.abspath(target)
    return os.path.join(os.path.dirname(target), TMP + os.path.basename(target))


def clear(*paths: str) -> None:
    """Remove what an interrupted save left at ``paths`` (files or directories; missing ones are fine)."""
    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.remove(path)


def replace_dir(new: str, target: str) -> None:
    """Move the complete directory ``new`` to ``target``, replacing what is there in one step where the OS
    can (Linux ``renameat2(RENAME_EXCHANGE)``), else by two renames with the old one parked at
    ``.tmp-<name>.old`` (a kill between them leaves ``target`` absent, never partial)."""
    if not os.path.lexists(target):
        os.rename(new, target)
        return
    if _exchange(new, target):
        shutil.rmtree(new)  # now the old directory
        return
    old = staging_dir(target) + ".old"
    clear(old)
    os.rename(target, old)
    os.rename(new, target)
    shutil.rmtree(old)


def publish_files(staging: str, target: str) -> list[str]:
    """Move what ``staging`` holds into the existing directory ``target`` so that ``target`` has its commit file
    (``COMMIT_FILES``) only while every file of one save is there; ``staging`` goes last. Returns the names."""
    names = sorted(os.listdir(staging))
    commits = [n for n in names if n in COMMIT_FILES]
    for name in COMMIT_FILES:  # from here until the new one is in, target is no model: never a mixed one
        clear(os.path.join(target, name))
    for name in os.listdir(target):
        if _WEIGHTS.match(name) and name not in names:
            clear(os.path.join(target, name))
    for name in [n for n in names if n not in commits] + commits:
        src, dst = os.path.join(staging, name), os.path.join(target, name)
        if os.path.isdir(src):
            replace_dir(src, dst)
        else:
            os.replace(src, dst)
    shutil.rmtree(staging)
    return names


def write_json(path: str, data) -> None:
    """``json.dump`` to ``path`` through a temporary sibling file renamed over it."""
    tmp = staging_dir(path)
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


def _exchange(a: str, b: str) -> bool:
    """Swap two directories in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the OS or the
    file system does not offer it."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0
