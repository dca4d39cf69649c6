"""Tokenizers: byte-level (default, nothing to train) and SentencePiece (a `.model` file).

Special ids follow the LLaMA-2 SentencePiece convention so that configs, packing and the loss mask
do not depend on the tokenizer: 0 = pad (LLaMA: `<unk>`), 1 = BOS, 2 = EOS.

* `ByteTokenizer`: UTF-8 bytes. id 0 = PAD, 1 = BOS, 2 = EOS, byte b -> id b + 3 (the ByT5
  layout, with BOS in place of ByT5's UNK). vocab_size = 259; the model pads it to a multiple of
  128 (`padded_vocab_size`). Decoding skips the special ids and replaces invalid UTF-8.
* `SentencePieceTokenizer(model_path)`: any SentencePiece model, e.g. the 32k LLaMA-2
  `tokenizer.model` used by the paper, or one trained on the embedded corpus by
  `experiments/train_tokenizer.py` (which uses unk 0, BOS 1, EOS 2, no pad, byte fallback, as
  LLaMA-2 does). A model without a pad id pads with 0; padded targets are masked out of the
  loss, so the pad id's meaning never matters.
* `get_tokenizer("byte" | path/to/file.model)`.

Tokenizers are picklable (grain workers are spawned processes): the SentencePiece tokenizer
pickles its serialized model proto, not the C++ object.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2


def padded_vocab_size(vocab_size: int, multiple: int = 128) -> int:
  """The embedding size: vocab_size rounded up to a multiple (docs/MATH.md §6.1: of 128)."""
  return -(-vocab_size // multiple) * multiple


class ByteTokenizer:
  """UTF-8 byte tokenizer: byte b -> b + 3; 0 = pad, 1 = BOS, 2 = EOS."""

  name = "byte"
  offset = 3
  pad_id = PAD_ID
  bos_id = BOS_ID
  eos_id = EOS_ID
  vocab_size = 256 + offset

  def encode(self, text: str) -> np.ndarray:
    """text -> int32 ids `[n_bytes]` (no BOS/EOS: the pipeline adds them)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) + self.offset

  def decode(self, ids: Iterable[int]) -> str:
    ids = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64)
    ids = ids[ids >= self.offset] - self.offset
    return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

  def __repr__(self):
    return "ByteTokenizer()"


class SentencePieceTokenizer:
  """A SentencePiece model file (`.model`), e.g. LLaMA-2's 32k `tokenizer.model`."""

  def __init__(self, model_path: str | os.PathLike | None = None, *, model_proto: bytes | None = None):
    if (model_path is None) == (model_proto is None):
      raise ValueError("Pass exactly one of model_path and model_proto")
    if model_proto is None:
      if not os.path.isfile(model_path):
        raise FileNotFoundError(f"SentencePiece model file not found: {model_path}")
      with open(model_path, "rb") as f:
        model_proto = f.read()
    self.model_path = None if model_path is None else os.fspath(model_path)
    self._proto = model_proto
    self._load()

  def _load(self):
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top

    self._sp = spm.SentencePieceProcessor(model_proto=self._proto)
    self.vocab_size = int(self._sp.get_piece_size())
    self.bos_id = int(self._sp.bos_id())
    self.eos_id = int(self._sp.eos_id())
    if self.eos_id < 0:
      raise ValueError(f"SentencePiece model {self.model_path} has no EOS id; the pipeline needs one")
    pad = int(self._sp.pad_id())
    self.pad_id = pad if pad >= 0 else PAD_ID
    self.name = self.model_path or "sentencepiece"

  def encode(self, text: str) -> np.ndarray:
    """text -> int32 ids `[n]` (no BOS/EOS: the pipeline adds them)."""
    return np.asarray(self._sp.encode(text, out_type=int), dtype=np.int32)

  def decode(self, ids: Iterable[int]) -> str:
    return self._sp.decode([int(i) for i in ids])

  def __getstate__(self):
    return {"model_path": self.model_path, "proto": self._proto}

  def __setstate__(self, state):
    self.model_path = state["model_path"]
    self._proto = state["proto"]
    self._load()

  def __repr__(self):
    return f"SentencePieceTokenizer({self.model_path!r}, vocab_size={self.vocab_size})"


Tokenizer = ByteTokenizer | SentencePieceTokenizer


def get_tokenizer(name_or_path: str | os.PathLike = "byte") -> Tokenizer:
  """"byte" -> `ByteTokenizer`; a path to a `.model` file -> `SentencePieceTokenizer`."""
  if str(name_or_path) == "byte":
    return ByteTokenizer()
  if os.path.isfile(name_or_path):
    return SentencePieceTokenizer(name_or_path)
  raise ValueError(
      f"Unknown tokenizer {str(name_or_path)!r}: expected 'byte' or the path of an existing "
      "SentencePiece .model file (train one with experiments/train_tokenizer.py)")


def train_sentencepiece(
    documents: Iterable[str],
    output_prefix: str | os.PathLike,
    vocab_size: int,
    *,
    model_type: str = "bpe",
    character_coverage: float = 1.0,
    byte_fallback: bool = True,
    max_sentences: int = 2_000_000,
    num_threads: int = 2,
    seed: int = 42,
) -> str:
  """Trains a SentencePiece model on documents; returns the path of the `.model` file.

  Each non-empty line of each document is one training sentence (SentencePiece works on
  sentences). Settings follow LLaMA-2: BPE, unk 0, BOS 1, EOS 2, no pad, byte fallback (no input
  is ever `<unk>`), identity normalisation (decode(encode(text)) == text), digits split.

  Args:
    documents: texts.
    output_prefix: writes `{output_prefix}.model` and `{output_prefix}.vocab`. A trailing
      ".model" is dropped.
    vocab_size: pieces in the model (LLaMA-2: 32000). With byte fallback it must exceed 259.
    model_type: "bpe" (LLaMA-2) or "unigram".
    max_sentences: SentencePiece's input_sentence_size (a random sample if the input is larger).
  """
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top

  prefix = os.fspath(output_prefix)
  if prefix.endswith(".model"):
    prefix = prefix[: -len(".model")]
  os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)

  def sentences():
    for doc in documents:
      for line in doc.splitlines():
        if line.strip():
          yield line

  spm.set_random_generator_seed(seed)  # input sampling and shuffling
  spm.SentencePieceTrainer.train(
      sentence_iterator=sentences(),
      model_prefix=prefix,
      vocab_size=vocab_size,
      model_type=model_type,
      character_coverage=character_coverage,
      byte_fallback=byte_fallback,
      # As LLaMA-2: keep text as is (newlines and runs of spaces survive a round trip; "\n"
      # becomes the byte piece <0x0A>), split digits.
      normalization_rule_name="identity",
      remove_extra_whitespaces=False,
      allow_whitespace_only_pieces=True,
      split_digits=True,
      unk_id=0,
      bos_id=BOS_ID,
      eos_id=EOS_ID,
      pad_id=-1,
      input_sentence_size=max_sentences,
      shuffle_input_sentence=True,
      num_threads=num_threads,
      minloglevel=2,
  )
  return prefix + ".model"
