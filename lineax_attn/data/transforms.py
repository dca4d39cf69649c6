"""The pipeline's grain stages (lineax_attn/data/pipeline.py has the whole pipeline).

Apart from pipeline.py because they subclass grain types, so they need grain at import (about a
second with the orbax it pulls in); `pipeline` imports this module only when it builds a dataset,
so a program that just reads a `DataConfig` (the CLIs, `--help`) never loads grain.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import grain
import numpy as np


class DecodeRecord(grain.transforms.Map):
  """ArrayRecord bytes -> document text (raw UTF-8, or JSON object's text_field)."""

  def __init__(self, text_field: str | None):
    self._text_field = text_field

  def map(self, record: bytes) -> str:
    text = record.decode("utf-8", errors="replace")
    if self._text_field is None:
      return text
    obj = json.loads(text)
    if self._text_field not in obj:
      raise KeyError(f"ArrayRecord JSON record has no field {self._text_field!r}")
    return str(obj[self._text_field])



class Tokenize(grain.transforms.Map):
  """Document text -> {"tokens": int32 [n]} = [BOS] + ids + [EOS]."""

  def __init__(self, tokenizer, add_bos: bool):
    self._tokenizer = tokenizer
    self._add_bos = add_bos

  def map(self, text: str) -> dict[str, np.ndarray]:
    ids = self._tokenizer.encode(text)
    parts = [ids, np.asarray([self._tokenizer.eos_id], np.int32)]
    if self._add_bos:
      parts.insert(0, np.asarray([self._tokenizer.bos_id], np.int32))
    return {"tokens": np.concatenate(parts).astype(np.int32)}


class NonEmpty(grain.transforms.Filter):
  def filter(self, text: str) -> bool:
    return bool(text.strip())


class ShiftAndMask(grain.transforms.Map):
  """A packed row of seq_len + 1 tokens -> inputs, targets, segment_ids, positions, loss_mask."""

  def __init__(self, reset_at_document_boundaries: bool, pad_id: int):
    self._reset = reset_at_document_boundaries
    self._pad_id = pad_id

  def map(self, row: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    tokens = np.asarray(row["tokens"], np.int32)
    seg = np.asarray(row["tokens_segment_ids"], np.int32)
    pos = np.asarray(row["tokens_positions"], np.int32)
    real = seg != 0
    tokens = np.where(real, tokens, self._pad_id).astype(np.int32)
    if self._reset:
      segment_ids, positions = seg[:-1], pos[:-1]
      keep = (seg[1:] == seg[:-1]) & real[1:]
    else:
      segment_ids = real[:-1].astype(np.int32)
      positions = np.arange(len(tokens) - 1, dtype=np.int32)
      keep = real[1:] & real[:-1]
    return {
        "inputs": tokens[:-1],
        "targets": tokens[1:],
        "segment_ids": segment_ids,
        "positions": positions,
        "loss_mask": keep.astype(np.float32),
    }


def _tuple_slices(state):
  """Undoes JSON's tuple -> list on ConcatThenSplit's `remainder_slices`, at any depth."""
  if isinstance(state, dict):
    return {k: ({f: tuple(v) for f, v in val.items()} if k == "remainder_slices"
                else _tuple_slices(val)) for k, val in state.items()}
  if isinstance(state, list):
    return [_tuple_slices(v) for v in state]
  return state


class JsonSafeStateIterator(grain.DatasetIterator):
  """Passes elements through; `set_state` accepts a state that went through JSON.

  Works around grain 0.2.18: ConcatThenSplitIterDataset compares its remainder slices with the
  tuple (-1, -1), so after a JSON round trip (grain's own orbax handler writes JSON) a list
  [-1, -1] reads as "has a remainder", one element is consumed and the restored iterator runs
  ahead of the saved one.
  """

  def __next__(self):
    return next(self._parent)

  def get_state(self):
    return self._parent.get_state()

  def set_state(self, state):
    self._parent.set_state(_tuple_slices(state))


class JsonSafeState(grain.IterDataset):
  def __iter__(self):
    return JsonSafeStateIterator(self._parent.__iter__())
