"""Synthetic recall tasks: MQAR (docs/MATH.md §7.1) and RULER-style needle-in-a-haystack (§7.2).

MQAR (Zoology's multi-query associative recall), per example of length T with N pairs:

    positions 0..2N-1:   k_1 v_1 k_2 v_2 ... k_N v_N      keys in [1, V/2), values in [V/2, V)
    query region:        k_j at 2N + 2·gap_j, gaps distinct, p(gap = i) ∝ (i + 1)^(a - 1)
    everything else:     uniform random tokens from [0, V)
    labels:              v_j at position 2N + 2·gap_j, -100 elsewhere

so the model reads the key at a query position and must emit its value there (inputs and labels
are aligned, no shift). `mqar(...)` draws `count` examples at once with numpy, vectorised:
distinct keys/values by rejection of rows with a repeat (exact: uniform over distinct tuples),
gaps by Gumbel-top-k on log p (exactly the sequential weighted sampling without replacement
that Zoology's `np.random.choice(replace=False, p=p)` does). Examples are drawn in blocks of
`BLOCK` rows, each from its own `SeedSequence((seed, block))`, so example i does not depend on
`count` and a random-access source can make any example without making the others.

`MQARSource` is a grain random-access data source of training rows in the pipeline's dict
layout (`inputs`, `targets`, `segment_ids`, `positions`, `loss_mask`), and `mqar_dataset`
turns it into shuffled, repeated, batched grain `IterDataset` with a checkpointable iterator.
`lineax_attn.data.pipeline.build_dataset` uses it when `data.source` is an MQAR spec string
such as "mqar:vocab=8192,num_pairs=16" (`parse_mqar_source`), so the `Trainer` and
`experiments.train` run on MQAR unchanged.

Needle in a haystack (RULER's niah tasks), `niah_example(task, length, depth, ...)`:

| task     | haystack                  | value          | needles                  |
|----------|---------------------------|----------------|--------------------------|
| s_niah_1 | repeated filler ("noise") | 7-digit number | 1                        |
| s_niah_2 | Shakespeare ("essay")     | 7-digit number | 1                        |
| s_niah_3 | Shakespeare               | UUID           | 1                        |
| mk_niah_1| Shakespeare               | 7-digit number | 4 (3 distractor keys)    |

The needle "One of the special magic numbers for {key} is: {value}." sits at `depth` (a fraction
of the haystack, at a sentence boundary); the prompt (RULER's template) ends with the question
and the answer prefix (RULER's template, or a one-line "short" one), and fits in `length` tokens of the given tokenizer. The essay haystack is
the embedded corpus's validation plays (text a model trained on the train split has not seen).
`string_match_all(prediction, answers)` is RULER's score: the share of answers that occur in the
prediction (case-insensitive), x100.

`NiahDocuments` is the training side of the same tasks: documents made of a needle prompt and
its answer, from the train split's haystack and seeds no evaluation uses, which
`pipeline.build_dataset` mixes into a text corpus (`data.niah_mix`). A model trained on the
corpus alone never sees the pattern the needle tasks ask for, so it cannot score on them at any
context length (docs/EXPERIMENTS.md, "NIAH of the small models").
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence

import numpy as np

IGNORE = -100
BLOCK = 1024  # examples per independently seeded block


# ------------------------------------------------------------------------------------- MQAR


@dataclasses.dataclass(frozen=True)
class MQARConfig:
  """One MQAR task (docs/MATH.md §7.1): vocabulary V, length T, N key-value pairs, gap power a."""

  vocab: int = 8192
  seq_len: int = 64
  num_pairs: int = 4
  power: float = 0.01

  def __post_init__(self):
    for name in ("vocab", "seq_len", "num_pairs"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"MQAR {name} must be a positive int, got {value!r}.")
    if self.seq_len % 2:
      raise ValueError(f"MQAR seq_len must be even, got {self.seq_len}.")
    if self.vocab <= self.seq_len:
      raise ValueError(f"MQAR needs vocab > seq_len, got vocab={self.vocab}, "
                       f"seq_len={self.seq_len}.")
    if 4 * self.num_pairs > self.seq_len:
      raise ValueError(f"MQAR needs 4 * num_pairs <= seq_len, got num_pairs={self.num_pairs}, "
                       f"seq_len={self.seq_len}.")
    if not 0.0 < float(self.power) <= 1.0:
      raise ValueError(f"MQAR power must be in (0, 1], got {self.power}.")

  @property
  def space(self) -> int:
    """Number of possible gaps, (T - 2N) / 2."""
    return (self.seq_len - 2 * self.num_pairs) // 2


def gap_probabilities(space: int, power: float) -> np.ndarray:
  """p(gap = i) ∝ (i + 1)^(a - 1), i = 0..space-1 (float64, sums to 1)."""
  p = np.arange(1, space + 1, dtype=np.float64) ** (power - 1.0)
  return p / p.sum()


def _distinct_rows(rng: np.random.Generator, n: int, k: int, low: int, high: int) -> np.ndarray:
  """`[n, k]` int64, each row k distinct ints uniform from [low, high), in random order.

  Rejection of whole rows that contain a repeat: the accepted rows are uniform over ordered
  distinct k-tuples. Needs high - low >= k.
  """
  out = rng.integers(low, high, size=(n, k))
  while True:
    s = np.sort(out, axis=1)
    bad = np.flatnonzero(np.any(s[:, 1:] == s[:, :-1], axis=1))
    if bad.size == 0:
      return out
    out[bad] = rng.integers(low, high, size=(bad.size, k))


def _mqar_block(cfg: MQARConfig, seed: int, block: int, n: int) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(np.random.SeedSequence((int(seed), int(block))))
  v, t, pairs = cfg.vocab, cfg.seq_len, cfg.num_pairs
  half = v // 2
  keys = _distinct_rows(rng, n, pairs, 1, half)
  values = _distinct_rows(rng, n, pairs, half, v)
  # Gumbel-top-k = weighted sampling without replacement (Plackett-Luce), like np.random.choice.
  log_p = np.log(gap_probabilities(cfg.space, cfg.power))
  scores = log_p[None, :] + rng.gumbel(size=(n, cfg.space))
  top = np.argpartition(-scores, pairs - 1, axis=1)[:, :pairs]
  # In draw order (descending score), as the sequential sampler returns them: key j is queried
  # at gap j, so the query order is random, not the context order.
  order = np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1)
  gaps = np.take_along_axis(top, order, axis=1)
  inputs = rng.integers(0, v, size=(n, t))  # random_non_queries: every free slot
  inputs[:, 0:2 * pairs:2] = keys
  inputs[:, 1:2 * pairs:2] = values
  query_pos = 2 * pairs + 2 * gaps
  rows = np.arange(n)[:, None]
  inputs[rows, query_pos] = keys
  labels = np.full((n, t), IGNORE, np.int64)
  labels[rows, query_pos] = values
  return inputs.astype(np.int32), labels.astype(np.int32)


@functools.lru_cache(maxsize=64)
def _cached_block(cfg: MQARConfig, seed: int, block: int) -> tuple[np.ndarray, np.ndarray]:
  inputs, labels = _mqar_block(cfg, seed, block, BLOCK)
  inputs.setflags(write=False)
  labels.setflags(write=False)
  return inputs, labels


def mqar(vocab: int, seq_len: int, num_pairs: int, *, count: int, seed: int = 0,
         power: float = 0.01) -> tuple[np.ndarray, np.ndarray]:
  """`count` MQAR examples (docs/MATH.md §7.1).

  Args:
    vocab: V (> seq_len). Keys come from [1, V/2), values from [V/2, V).
    seq_len: T (even, >= 4 * num_pairs).
    num_pairs: N key-value pairs per example.
    count: number of examples.
    seed: examples with the same seed and index are identical, whatever `count` is.
    power: a of the gap distribution p(i) ∝ (i + 1)^(a - 1).

  Returns:
    (inputs `[count, T]` int32, labels `[count, T]` int32 with -100 where unlabelled).
  """
  cfg = MQARConfig(vocab=vocab, seq_len=seq_len, num_pairs=num_pairs, power=power)
  if not isinstance(count, (int, np.integer)) or count < 0:
    raise ValueError(f"count must be a non-negative int, got {count!r}.")
  n_blocks = -(-count // BLOCK)
  parts = [_mqar_block(cfg, seed, b, BLOCK) for b in range(n_blocks)]
  if not parts:
    return np.zeros((0, seq_len), np.int32), np.zeros((0, seq_len), np.int32)
  inputs = np.concatenate([p[0] for p in parts])[:count]
  labels = np.concatenate([p[1] for p in parts])[:count]
  return inputs, labels


def mqar_batch(inputs: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
  """MQAR rows -> the training dict of the pipeline: inputs, targets (labels with -100 -> 0),
  segment_ids (all 1), positions, loss_mask (1 at labelled positions); all `[B, T]`."""
  inputs = np.asarray(inputs, np.int32)
  labels = np.asarray(labels, np.int32)
  if inputs.shape != labels.shape or inputs.ndim not in (1, 2):
    raise ValueError(f"inputs and labels must have the same shape [B, T] or [T], got "
                     f"{inputs.shape} and {labels.shape}.")
  mask = labels != IGNORE
  t = inputs.shape[-1]
  return {
      "inputs": inputs,
      "targets": np.where(mask, labels, 0).astype(np.int32),
      "segment_ids": np.ones_like(inputs),
      "positions": np.broadcast_to(np.arange(t, dtype=np.int32), inputs.shape).copy(),
      "loss_mask": mask.astype(np.float32),
  }


class MQARSource:
  """Grain random-access data source: example i of an MQAR task as a training row dict.

  Blocks of `BLOCK` examples are generated on demand (vectorised) and cached, so reading in
  any order costs about as much as `mqar(...)` of the same count. Picklable (grain workers).
  """

  def __init__(self, config: MQARConfig, *, count: int, seed: int = 0):
    if not isinstance(config, MQARConfig):
      raise ValueError(f"config must be an MQARConfig, got {type(config).__name__}.")
    if count < 1:
      raise ValueError(f"count must be >= 1, got {count}.")
    self.config, self.count, self.seed = config, int(count), int(seed)

  def __len__(self) -> int:
    return self.count

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = int(index)
    if not 0 <= index < self.count:
      raise IndexError(f"MQAR example {index} out of range [0, {self.count}).")
    inputs, labels = _cached_block(self.config, self.seed, index // BLOCK)
    return mqar_batch(inputs[index % BLOCK], labels[index % BLOCK])

  def __repr__(self):
    return f"MQARSource({self.config}, count={self.count}, seed={self.seed})"


MQAR_PREFIX = "mqar"
_MQAR_FIELDS = {"vocab": int, "num_pairs": int, "power": float, "count": int}


def is_mqar_source(source: str) -> bool:
  """Whether a `data.source` string names an MQAR task ("mqar" or "mqar:k=v,...")."""
  return str(source).split(":", 1)[0].strip().lower() == MQAR_PREFIX


def parse_mqar_source(source: str) -> dict:
  """"mqar:vocab=8192,num_pairs=16,power=0.01,count=100000" -> a dict of those fields.

  Defaults: vocab 8192, num_pairs 8, power 0.01, count 100000. The length is the data
  config's seq_len.
  """
  if not is_mqar_source(source):
    raise ValueError(f"not an MQAR source: {source!r} (expected 'mqar:vocab=...,num_pairs=...').")
  out = {"vocab": 8192, "num_pairs": 8, "power": 0.01, "count": 100_000}
  rest = str(source).split(":", 1)[1] if ":" in str(source) else ""
  for item in filter(None, (s.strip() for s in rest.split(","))):
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or key not in _MQAR_FIELDS:
      raise ValueError(f"bad MQAR source field {item!r} in {source!r}; expected k=v with k in "
                       f"{sorted(_MQAR_FIELDS)}.")
    try:
      out[key] = _MQAR_FIELDS[key](value)
    except ValueError as e:
      raise ValueError(f"MQAR source field {key}={value!r} is not a {_MQAR_FIELDS[key].__name__}.") from e
  return out


def mqar_config_from_source(source: str, seq_len: int) -> MQARConfig:
  """The (validated) MQARConfig of a source string at length seq_len."""
  fields = parse_mqar_source(source)
  return MQARConfig(vocab=fields["vocab"], seq_len=seq_len, num_pairs=fields["num_pairs"],
                    power=fields["power"])


def mqar_dataset(source: str, *, seq_len: int, batch_size: int, seed: int,
                 shuffle: bool = True, num_epochs: int | None = None, shard_index: int = 0,
                 shard_count: int = 1):
  """A grain IterDataset of `[batch_size, seq_len]` MQAR training dicts from a source string.

  Examples `shard_index::shard_count` (one shard per process), shuffled per epoch with `seed`,
  repeated `num_epochs` times (None: forever); the examples themselves are drawn with `seed`
  too, so a validation config with another seed gets other examples.
  """
  import grain  # pylint: disable=g-import-not-at-top

  cfg = mqar_config_from_source(source, seq_len)
  count = parse_mqar_source(source)["count"]
  ds = grain.MapDataset.source(MQARSource(cfg, count=count, seed=seed))
  ds = ds[shard_index::shard_count]
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat(num_epochs)
  return ds.to_iter_dataset().batch(batch_size, drop_remainder=True)


# ------------------------------------------------------------------------------------- NIAH

NIAH_TASKS = ("s_niah_1", "s_niah_2", "s_niah_3", "mk_niah_1")
# task -> (haystack, value kind, number of needles)
_TASK_SPECS = {
    "s_niah_1": ("noise", "number", 1),
    "s_niah_2": ("essay", "number", 1),
    "s_niah_3": ("essay", "uuid", 1),
    "mk_niah_1": ("essay", "number", 4),
}
NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
         "There and back again.")
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
TEMPLATES = {"ruler": ("Some special magic {kind} are hidden within the following text. Make sure to "
            "memorize it. I will quiz you about the {kind} afterwards.\n{context}\n"
            "What are all the special magic {kind} for {key} mentioned in the provided text?"),
             # For short budgets (CPU tests, tiny models): the same needle, a one-line question.
             "short": "{context}\nWhat is the special magic {one} for {key}?"}
ANSWER_PREFIXES = {"ruler": " The special magic {kind} for {key} mentioned in the provided text are",
                   "short": " The special magic {one} for {key} is:"}
# Needle keys are "adjective-noun" words (RULER draws them with `wonderwords`).
_ADJECTIVES = ("abundant", "ancient", "bitter", "brave", "calm", "clever", "crooked", "damp",
               "eager", "elegant", "faint", "fierce", "gentle", "glossy", "hollow", "humble",
               "icy", "jolly", "keen", "lively", "mellow", "narrow", "nimble", "odd", "placid",
               "quiet", "rapid", "rustic", "shiny", "silent", "tender", "vivid", "wary", "witty",
               "young", "zealous")
_NOUNS = ("anchor", "badge", "basket", "beacon", "canyon", "cellar", "compass", "cottage",
          "dragon", "ember", "falcon", "feather", "garden", "harbor", "helmet", "island",
          "jacket", "kettle", "ladder", "lantern", "meadow", "mirror", "needle", "orchard",
          "parcel", "pepper", "quarry", "ribbon", "saddle", "spider", "teacup", "tunnel",
          "valley", "wagon", "walnut", "window")


@dataclasses.dataclass(frozen=True)
class NiahExample:
  """One NIAH prompt: feed `prompt` (it ends with the answer prefix), expect `answers`."""

  task: str
  prompt: str
  answers: tuple[str, ...]
  key: str                      # the queried key
  keys: tuple[str, ...]         # all needle keys (the queried one first)
  depth: float                  # requested depth of the queried needle, in [0, 1]
  length: int                   # the token budget
  num_tokens: int               # tokens of the prompt (<= length)
  needle_offset: int            # character offset of the queried needle in the prompt
  haystack_depth: float         # realised depth: haystack characters before the needle / all


def _sentences(text: str, max_chars: int = 120) -> list[str]:
  """Splits text into sentences, and a sentence longer than max_chars into runs of words, so
  that needles can be placed finely even in short haystacks."""
  out = []
  for sentence in re.split(r"(?<=[.!?])\s+", text.replace("\n", " ")):
    words, run = sentence.split(), []
    for word in words:
      if run and len(" ".join(run + [word])) > max_chars:
        out.append(" ".join(run))
        run = []
      run.append(word)
    if run:
      out.append(" ".join(run))
  return out


@functools.lru_cache(maxsize=4)
def _essay_sentences(split: str) -> tuple[str, ...]:
  from lineax_attn.data import corpus  # pylint: disable=g-import-not-at-top
  return tuple(_sentences("\n".join(corpus.load_documents(split))))


def _haystack_units(haystack: str, rng: np.random.Generator, split: str) -> list[str]:
  if haystack == "noise":
    return _sentences(NOISE)
  units = _essay_sentences(split)
  start = int(rng.integers(0, len(units)))  # a different stretch of text per example
  return list(units[start:]) + list(units[:start])


def _value(kind: str, rng: np.random.Generator) -> str:
  if kind == "number":
    return str(int(rng.integers(1_000_000, 10_000_000)))
  h = "".join(f"{x:x}" for x in rng.integers(0, 16, size=32))
  return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _keys(rng: np.random.Generator, n: int) -> list[str]:
  pairs = len(_ADJECTIVES) * len(_NOUNS)
  idx = rng.choice(pairs, size=n, replace=False)
  return [f"{_ADJECTIVES[i // len(_NOUNS)]}-{_NOUNS[i % len(_NOUNS)]}" for i in idx]


def _build(units: list[str], n_units: int, needles: list[tuple[float, str]], kind: str,
           key: str, template: str) -> tuple[str, int, float]:
  """(prompt, character offset of needle 0 in the prompt, its realised depth) with the needles
  (depth, text) inserted at unit boundaries of the first n_units haystack units."""
  reps = -(-n_units // max(len(units), 1))
  hay = (units * max(reps, 1))[:n_units]
  # Each needle goes to the unit boundary whose character offset is nearest depth x haystack.
  bounds = np.concatenate([[0], np.cumsum([len(s) + 1 for s in hay])])
  total = bounds[-1]
  inserts = sorted(((int(np.argmin(np.abs(bounds - d * total))), i, text)
                    for i, (d, text) in enumerate(needles)), key=lambda x: (x[0], x[1]))
  pieces, cursor, first = [], 0, (0, 0)
  for at, i, text in inserts:
    pieces.extend(hay[cursor:at])
    cursor = at
    if i == 0:
      first = (len(pieces), at)
    pieces.append(text)
  pieces.extend(hay[cursor:])
  marker = "\x00"  # locates needle 0 in the formatted prompt
  pieces[first[0]] = marker + pieces[first[0]]
  words = dict(kind=kind, one=kind[:-1], key=key)
  prompt = (TEMPLATES[template].format(context=" ".join(pieces), **words)
            + ANSWER_PREFIXES[template].format(**words))
  offset = prompt.index(marker)
  realised = float(bounds[first[1]] / total) if total else 0.0
  return prompt.replace(marker, ""), offset, realised


def niah_example(task: str, length: int, depth: float, *, tokenizer=None, seed: int = 0,
                 split: str = "validation", template: str = "ruler") -> NiahExample:
  """One RULER-style NIAH prompt of at most `length` tokens with the needle at `depth`.

  Args:
    task: one of NIAH_TASKS.
    length: token budget of the whole prompt (template, haystack, needles, question, prefix).
    depth: where the queried needle goes, a fraction of the haystack in [0, 1].
    tokenizer: any object with `encode(text) -> ids` (default: the byte tokenizer).
    seed: keys, values, distractor depths and the haystack stretch are a function of it.
    split: the corpus split of the essay haystack.
    template: "ruler" (RULER's niah prompt) or "short" (a one-line question, for short budgets).
  """
  if template not in TEMPLATES:
    raise ValueError(f"template must be one of {sorted(TEMPLATES)}, got {template!r}.")
  if task not in _TASK_SPECS:
    raise ValueError(f"task must be one of {NIAH_TASKS}, got {task!r}.")
  if not isinstance(length, (int, np.integer)) or length < 1:
    raise ValueError(f"length must be a positive int (tokens), got {length!r}.")
  if not 0.0 <= float(depth) <= 1.0:
    raise ValueError(f"depth must be in [0, 1], got {depth}.")
  if tokenizer is None:
    from lineax_attn.data.tokenizers import ByteTokenizer  # pylint: disable=g-import-not-at-top
    tokenizer = ByteTokenizer()
  haystack, value_kind, n_needles = _TASK_SPECS[task]
  kind = "numbers" if value_kind == "number" else "uuids"
  rng = np.random.default_rng(np.random.SeedSequence((int(seed), NIAH_TASKS.index(task),
                                                      int(length), int(round(depth * 1e6)))))
  keys = _keys(rng, n_needles)
  values = [_value(value_kind, rng) for _ in keys]
  needle_texts = [NEEDLE.format(kind=kind, key=k, value=v) for k, v in zip(keys, values)]
  # Distractor needles at random depths; the queried one (index 0) at the requested depth.
  needles = [(float(depth), needle_texts[0])] + [(float(rng.random()), t) for t in needle_texts[1:]]
  units = _haystack_units(haystack, rng, split)

  def size(n):
    prompt = _build(units, n, needles, kind, keys[0], template)[0]
    return len(tokenizer.encode(prompt)), prompt

  base, _ = size(0)
  if base > length:
    raise ValueError(f"length={length} tokens cannot hold the {task} template and needles "
                     f"({base} tokens without any haystack).")
  lo, hi = 0, 1
  while size(hi)[0] <= length:  # exponential then binary search on the number of units
    lo, hi = hi, hi * 2
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if size(mid)[0] <= length else (lo, mid)
  prompt, offset, realised = _build(units, lo, needles, kind, keys[0], template)
  return NiahExample(task=task, prompt=prompt, answers=(values[0],), key=keys[0],
                     keys=tuple(keys), depth=float(depth), length=int(length),
                     num_tokens=len(tokenizer.encode(prompt)), needle_offset=offset,
                     haystack_depth=realised)


def niah_tasks(task: str, lengths: Sequence[int], *, num_depths: int = 5,
               samples_per_depth: int = 1, tokenizer=None, seed: int = 0,
               split: str = "validation", template: str = "ruler") -> list[NiahExample]:
  """Examples at every length x evenly spaced depth (0, ..., 1) x sample."""
  if num_depths < 1 or samples_per_depth < 1:
    raise ValueError(f"num_depths ({num_depths}) and samples_per_depth ({samples_per_depth}) "
                     f"must be >= 1.")
  depths = np.linspace(0.0, 1.0, num_depths) if num_depths > 1 else np.asarray([0.5])
  return [niah_example(task, int(n), float(d), tokenizer=tokenizer, seed=seed * 1000 + s,
                       split=split, template=template)
          for n in lengths for d in depths for s in range(samples_per_depth)]


# Training needles draw their seeds from here on: `niah_tasks` uses seed * 1000 + sample.
TRAIN_SEED_BASE = 1 << 40


class NiahDocuments:
  """A random-access source of training documents: a needle prompt, then its answer.

  Document i is `prompt + " " + answer + ".\n"` for task `NIAH_TASKS[i % 4]`, the needle at a
  uniform random depth, the prompt's budget uniform between the task's smallest (its template
  and needles with 32 tokens of haystack) and 3/4 of `max_tokens`. The budget stays below the
  row so that most documents are packed whole into a training row: the pipeline concatenates
  documents and splits rows at `seq_len`, and a needle split from its question teaches nothing.
  Haystacks come from `split` (the train plays by default; the evaluation uses the validation
  ones), seeds from `TRAIN_SEED_BASE` up. Example i is a function of (seed, i) alone.
  """

  def __init__(self, *, max_tokens: int, tokenizer=None, seed: int = 0, split: str = "train",
               template: str = "ruler", count: int = 1 << 30):
    if template not in TEMPLATES:
      raise ValueError(f"template must be one of {sorted(TEMPLATES)}, got {template!r}.")
    if not isinstance(max_tokens, (int, np.integer)) or max_tokens < 2:
      raise ValueError(f"max_tokens must be an int >= 2, got {max_tokens!r}.")
    if count < 1:
      raise ValueError(f"count must be >= 1, got {count}.")
    if tokenizer is None:
      from lineax_attn.data.tokenizers import ByteTokenizer  # pylint: disable=g-import-not-at-top
      tokenizer = ByteTokenizer()
    self.max_tokens, self.tokenizer, self.seed = int(max_tokens), tokenizer, int(seed)
    self.split, self.template, self.count = split, template, int(count)
    self.high = self.max_tokens * 3 // 4
    self.low = {task: self._smallest_budget(task) + 32 for task in NIAH_TASKS}
    too_long = {task: low for task, low in self.low.items() if low > self.high}
    if too_long:
      raise ValueError(f"max_tokens={max_tokens} (the training seq_len) leaves {self.high} "
                       f"tokens for a needle document, fewer than the {template!r} template "
                       f"needs ({too_long}): use a longer seq_len or template='short'.")

  def _fits(self, task: str, budget: int) -> bool:
    try:
      niah_example(task, budget, 0.5, tokenizer=self.tokenizer, seed=TRAIN_SEED_BASE,
                   split=self.split, template=self.template)
    except ValueError:
      return False
    return True

  def _smallest_budget(self, task: str) -> int:
    """The fewest tokens that hold the task's template and needles (binary search)."""
    lo, hi = 0, max(self.max_tokens, 1)      # lo does not fit; hi may
    if not self._fits(task, hi):
      return hi + 1
    while hi - lo > 1:
      mid = (lo + hi) // 2
      lo, hi = (lo, mid) if self._fits(task, mid) else (mid, hi)
    return hi

  def __len__(self) -> int:
    return self.count

  def __getitem__(self, index: int) -> str:
    index = int(index)
    if not 0 <= index < self.count:
      raise IndexError(f"needle document {index} out of range [0, {self.count}).")
    rng = np.random.default_rng(np.random.SeedSequence((TRAIN_SEED_BASE, self.seed, index)))
    task = NIAH_TASKS[index % len(NIAH_TASKS)]
    example = niah_example(task, int(rng.integers(self.low[task], self.high + 1)),
                           float(rng.random()), tokenizer=self.tokenizer,
                           seed=TRAIN_SEED_BASE + int(rng.integers(0, 1 << 30)),
                           split=self.split, template=self.template)
    return f"{example.prompt} {example.answers[0]}.\n"

  def __repr__(self):
    return (f"NiahDocuments(max_tokens={self.max_tokens}, seed={self.seed}, "
            f"split={self.split!r}, template={self.template!r})")


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
  """RULER's score: 100 x the share of `answers` found in `prediction` (case-insensitive)."""
  if isinstance(answers, str):
    raise ValueError("answers must be a sequence of strings, not one string.")
  if not answers:
    raise ValueError("answers must not be empty.")
  pred = str(prediction).lower()
  return 100.0 * sum(str(a).lower() in pred for a in answers) / len(answers)
