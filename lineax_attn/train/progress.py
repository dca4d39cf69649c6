"""A progress line: step, loss, tokens/s, MFU and ETA.

On a terminal the line is redrawn in place every step and kept (a newline) every log interval;
into a file or pipe only the log-interval lines are written, so logs stay readable.

    [mixers_tiny/gdn]  step   50/150  loss 2.871  val 2.934  41.2k tok/s  mfu n/a  eta 0:00:12
"""

from __future__ import annotations

import datetime
import sys
from typing import TextIO


def format_count(x: float) -> str:
  """12345 -> "12.3k"; 2.1e6 -> "2.10M"."""
  for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if abs(x) >= scale:
      return f"{x / scale:.3g}{unit}"
  return f"{x:.3g}"


def format_eta(seconds: float | None) -> str:
  if seconds is None or seconds != seconds or seconds == float("inf"):
    return "?"
  return str(datetime.timedelta(seconds=int(round(seconds))))


class Progress:
  """Prints the progress line of one run (process 0 only: pass enabled=messages=False
  elsewhere)."""

  def __init__(self, name: str, total_steps: int, *, enabled: bool = True,
               messages: bool = True, stream: TextIO | None = None):
    self.name = name
    self.total = total_steps
    self.enabled = enabled
    self.messages = messages  # one-line messages (resumed, stopped) even without the bar
    self.stream = stream or sys.stderr
    self.interactive = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
    self._width = 0

  def line(self, step: int, loss: float, *, val_loss: float | None = None,
           tokens_per_s: float | None = None, mfu: float | None = None,
           eta_s: float | None = None) -> str:
    digits = len(str(self.total))
    parts = [f"[{self.name}]", f"step {step:>{digits}}/{self.total}", f"loss {loss:.4f}"]
    if val_loss is not None:
      parts.append(f"val {val_loss:.4f}")
    if tokens_per_s is not None:
      parts.append(f"{format_count(tokens_per_s)} tok/s")
    parts.append("mfu n/a" if mfu is None else f"mfu {100 * mfu:.1f}%")
    parts.append(f"eta {format_eta(eta_s)}")
    return "  ".join(parts)

  def update(self, step: int, loss: float, *, keep: bool = False, **kwargs) -> None:
    """Redraws the line (terminal) and, if `keep`, ends it with a newline (always written)."""
    if not self.enabled or not (keep or self.interactive):
      return
    text = self.line(step, loss, **kwargs)
    if self.interactive:
      pad = max(0, self._width - len(text))
      self.stream.write("\r" + text + " " * pad + ("\n" if keep else ""))
      self._width = 0 if keep else len(text)
    else:
      self.stream.write(text + "\n")
    self.stream.flush()

  def message(self, text: str) -> None:
    """A line of its own (ends a half-drawn progress line first)."""
    if not self.messages:
      return
    if self.interactive and self._width:
      self.stream.write("\n")
      self._width = 0
    self.stream.write(f"[{self.name}] {text}\n")
    self.stream.flush()
