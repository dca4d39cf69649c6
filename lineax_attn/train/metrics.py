"""Training metrics: a FLOPs model for the MFU estimate, and the JSONL + TensorBoard writer.

FLOPs per trained token (`train_flops_per_token`) = 3 x the forward FLOPs (backward = 2 x
forward; no rematerialisation counted):

* 2 N_matmul: every weight matrix, LM head included (embedding lookups are not matmuls; a
  tied embedding counts once, as the head). Gate vectors and norms are negligible.
* softmax attention, per layer: 2·2·H_q·d_h·T/2 (QKᵀ and AV over the causal half; a window w
  caps the context at w).
* linear mixers, per layer (the chunked form, chunk C, per value head): intra-chunk scores and
  outputs 2·C·(d_k + d_v), the state read and write 4·d_k·d_v, and for the delta-rule family
  the WY / UT transform 2·C·d_k more.

MFU = FLOPs per token x tokens/s / (peak FLOP/s per device x devices). Peak numbers are the
dense bf16 tensor-core figures of `PEAK_FLOPS` (so float32 runs show a low MFU); unknown
devices and CPUs give None ("n/a").
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from lineax_attn.models.config import SOFTMAX, ModelConfig

# Dense bf16 peak FLOP/s per device, by a substring of `jax.Device.device_kind` (first match).
PEAK_FLOPS = (
    ("GH200", 989e12), ("H200", 989e12), ("H100", 989e12), ("H800", 989e12),
    ("B200", 2250e12), ("B100", 1750e12), ("A100", 312e12), ("A800", 312e12),
    ("L40S", 362e12), ("L4", 121e12), ("A10G", 70e12),
    ("TPU v6 lite", 918e12), ("TPU v6e", 918e12), ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12), ("TPU v5p", 459e12), ("TPU v5", 459e12), ("TPU v4", 275e12),
)


def peak_flops(device) -> float | None:
  """Peak bf16 FLOP/s of one device (None for CPUs and unknown kinds)."""
  if getattr(device, "platform", "cpu") == "cpu":
    return None
  kind = str(getattr(device, "device_kind", ""))
  for name, flops in PEAK_FLOPS:
    if name.lower() in kind.lower():
      return flops
  return None


def matmul_params(config: ModelConfig, total_params: int) -> int:
  """Parameters that take part in matmuls: all but an untied input embedding."""
  embedding = config.vocab_size * config.d_model
  return total_params - (0 if config.tie_embeddings else embedding)


def mixer_flops_per_token(config: ModelConfig, seq_len: int) -> float:
  """Forward FLOPs per token of the token mixing itself (attention scores, chunk math), summed
  over layers; the projections are in 2 N_matmul."""
  total = 0.0
  for kind in config.layer_types:
    if kind == SOFTMAX:
      dh = config.attn_head_dim or config.d_model // config.attn_heads
      context = seq_len / 2 if config.window is None else min(config.window, seq_len / 2)
      total += 4.0 * config.attn_heads * dh * context
    else:
      c = min(config.chunk_size, seq_len)
      per_head = 2.0 * c * (config.dk + config.dv) + 4.0 * config.dk * config.dv
      if kind != "linear_attention":
        per_head += 2.0 * c * config.dk
      total += config.v_heads * per_head
  return total


def train_flops_per_token(config: ModelConfig, total_params: int, seq_len: int) -> float:
  """Training FLOPs per token: 3 x (2 N_matmul + token mixing)."""
  return 3.0 * (2.0 * matmul_params(config, total_params) + mixer_flops_per_token(config, seq_len))


def mfu(flops_per_token: float, tokens_per_second: float, devices) -> float | None:
  """Model FLOPs utilisation in [0, 1], or None when a device's peak is unknown (CPU)."""
  peaks = [peak_flops(d) for d in devices]
  if not peaks or any(p is None for p in peaks):
    return None
  return flops_per_token * tokens_per_second / float(sum(peaks))


def _scalar(value) -> Any:
  value = np.asarray(value).item() if hasattr(value, "shape") else value
  if isinstance(value, float) and not np.isfinite(value):
    return str(value)  # JSON has no NaN/Inf: keep them readable
  return value


class MetricWriter:
  """Appends `{"step", "kind", "time", **scalars}` lines to `<workdir>/metrics.jsonl` and the
  same scalars to TensorBoard (`<workdir>/tensorboard`, tag `kind/name`). Process 0 writes;
  other processes pass `enabled=False` and nothing is written.

  `discard_after_step`: the step a run restarts from, for a run that continues in a workdir
  (the restored checkpoint's step; -1 for a fresh start). A run killed after its last
  checkpoint logged steps that the new run does again; so records with a later step are
  dropped from metrics.jsonl (rewritten, a torn last line dropped too), and TensorBoard's event
  files are replaced by one file written from the records kept (their wall times too), so no
  step shows twice in either. None: append to what is there.
  """

  def __init__(self, workdir: str, *, enabled: bool = True, tensorboard: bool = True,
               discard_after_step: int | None = None):
    self.enabled = enabled
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._tb = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    kept = None
    if discard_after_step is not None:
      kept = [r for r in _read_records(self.path) if r["step"] <= discard_after_step]
      temporary = self.path + ".tmp"
      with open(temporary, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
      os.replace(temporary, self.path)
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      except ImportError:  # the JSONL log is enough; TensorBoard is optional
        return
      logdir = os.path.join(workdir, "tensorboard")
      if kept is not None and os.path.isdir(logdir):
        for name in os.listdir(logdir):
          if name.startswith("events.out.tfevents."):
            os.remove(os.path.join(logdir, name))
      self._tb = SummaryWriter(logdir)
      for record in kept or ():
        self._tb_write(record)

  def write(self, step: int, kind: str, scalars: Mapping[str, Any]) -> None:
    if not self.enabled:
      return
    record = {"step": int(step), "kind": kind, "time": time.time()}
    record.update({k: _scalar(v) for k, v in scalars.items() if v is not None})
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    self._tb_write(record)

  def _tb_write(self, record: Mapping[str, Any]) -> None:
    if self._tb is None:
      return
    for key, value in record.items():
      if key not in ("step", "kind", "time") and isinstance(value, (int, float)):
        self._tb.add_scalar(f"{record['kind']}/{key}", value, int(record["step"]),
                            walltime=record.get("time"))

  def flush(self) -> None:
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
      self._tb = None


def _read_records(path: str) -> list[dict[str, Any]]:
  """The records of a metrics.jsonl in file order; a line that is no JSON record (the torn last
  line of a killed process) is skipped."""
  if not os.path.exists(path):
    return []
  records = []
  with open(path) as f:
    for line in f:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(record, dict) and "step" in record and "kind" in record:
        records.append(record)
  return records


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """The records of `<workdir>/metrics.jsonl`; for a step logged twice (a log written before
  `MetricWriter(discard_after_step=...)` existed) the later record wins. Sorted by (kind,
  step)."""
  latest: dict[tuple[str, int], dict[str, Any]] = {}
  for record in _read_records(os.path.join(workdir, "metrics.jsonl")):
    latest[(record["kind"], record["step"])] = record
  return [latest[k] for k in sorted(latest)]

