"""The launcher's terminal: every rank's output, prefixed, and rank 0's progress.

Workers' lines reach the launcher through pipes (ours, or torchrun's ``--tee``), so a
worker never sees a terminal and cannot draw a live progress bar itself. Instead rank 0
appends small JSON records to the file named by :data:`PROGRESS_ENV` (see
``ddpkit.train.progress``) and the launcher renders them:

* stderr is a terminal: one status line at the bottom, redrawn in place (``\\r``); a
  worker's output line first clears it, is printed, and the status comes back under it;
* otherwise: a plain line every :data:`EVERY_STEPS_ENV` steps (default: a tenth of the
  run), each with samples/s and the time left, so logs and CI output get progress
  without carriage-return clutter.

On a terminal nothing is drawn wider than :data:`MAX_COLUMNS` (or the terminal, when
narrower), and a console made with ``plain_prefix`` (``ddpkit train``) shows rank 0's
lines without the tee's prefix: rank 0 speaks for the job, so its lines need no name,
while another rank's lines (a traceback, a warning of its own) keep theirs.

Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from typing import Any, TextIO

PROGRESS_ENV = "DDPKIT_PROGRESS_FILE"  # where rank 0 appends its progress records
EVERY_STEPS_ENV = "DDPKIT_PROGRESS_EVERY_STEPS"  # steps between plain lines (not a terminal)
PLAIN_LINES = 10  # plain lines per run when EVERY_STEPS_ENV is not set
MAX_COLUMNS = 100  # the widest line drawn on a terminal, however wide it is


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def progress_text(record: dict[str, Any], eta: float | None) -> str:
    """``epoch 3/20 | step 36/240 (15%) | 8,123 samples/s | loss 0.4123 | peak RSS
    412 MiB | ETA 12s`` (peak RSS: the highest of the ranks', rank 0's now and the
    others' as of the last epoch's metrics; one figure, so the line keeps its ETA at any
    world size; ``ETA ?`` only on a terminal's first redraw, before any step has been
    timed)."""
    parts = []
    if record.get("epochs"):
        parts.append(f"epoch {record.get('epoch', '?')}/{record['epochs']}")
    step, total = record.get("step"), record.get("total_steps")
    if step is not None and total:
        parts.append(f"step {step}/{total} ({100 * step / total:.0f}%)")
    elif step is not None:
        parts.append(f"step {step}")
    rate = record.get("samples_per_s")
    if isinstance(rate, (int, float)) and math.isfinite(rate):
        parts.append(f"{rate:,.0f} samples/s")
    loss = record.get("loss")
    if isinstance(loss, (int, float)) and math.isfinite(loss):
        parts.append(f"loss {loss:.4f}")
    memory = record.get("peak_rss_mib")
    if isinstance(memory, list) and memory:
        parts.append(f"peak RSS {max(memory):.0f} MiB")
    parts.append(f"ETA {_duration(eta) if eta is not None else '?'}")
    return " | ".join(parts)


class Console:
    """Serialises the launcher's output and draws rank 0's progress.

    ``write(stream, text)`` writes whole lines (from any thread); ``start()`` begins
    following the progress file, ``close()`` stops and clears the status line.
    """

    def __init__(self, progress_file: str | None = None, *, stdout: TextIO | None = None,
                 stderr: TextIO | None = None, tty: bool | None = None,
                 every_steps: int | None = None, plain_prefix: str | None = None):
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr
        self.tty = self.stderr.isatty() if tty is None else tty
        if every_steps is None:
            try:
                every_steps = int(os.environ.get(EVERY_STEPS_ENV, "0"))
            except ValueError:
                every_steps = 0
        self.every_steps = every_steps  # 0: a tenth of the run's steps
        self.progress_file = progress_file
        self.plain_prefix = plain_prefix  # rank 0's tee prefix, left out on a terminal
        self._lock = threading.RLock()
        self._status = ""  # the status line currently drawn (terminal only)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._first: tuple[float, int] | None = None  # (time, step) of the first record
        self._last_plain_step: int | None = None
        self.lines_printed = 0  # progress lines (plain) or redraws (terminal)

    # ----------------------------------------------------------------- output
    def write(self, stream: TextIO, text: str) -> None:
        if self.plain_prefix and _is_terminal(stream):
            text = "".join(line.removeprefix(self.plain_prefix)
                           for line in text.splitlines(keepends=True))
        with self._lock:
            if self._status:
                self.stderr.write("\r\x1b[K")
                self.stderr.flush()
            stream.write(text)
            stream.flush()
            if self._status:
                self.stderr.write(self._status)
                self.stderr.flush()

    def proxy(self, stream: TextIO) -> _Proxy:
        """A file object whose writes go through :meth:`write` (for torchrun's tee)."""
        return _Proxy(self, stream)

    # ----------------------------------------------------------------- progress
    def start(self) -> Console:
        if self.progress_file and self._thread is None:
            self._thread = threading.Thread(target=self._follow, name="ddpkit-progress",
                                            daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        with self._lock:
            if self._status:
                self.stderr.write("\r\x1b[K")
                self.stderr.flush()
                self._status = ""

    def _follow(self) -> None:
        offset, pending = 0, b""
        while True:
            stopping = self._stop.wait(0.1)
            try:
                with open(self.progress_file, "rb") as fh:
                    fh.seek(offset)
                    chunk = fh.read()
            except OSError:
                chunk = b""
            offset += len(chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            latest = None
            for line in lines:
                try:
                    latest = json.loads(line)
                except ValueError:
                    continue
            if latest is not None and not stopping:
                self.show(latest)
            if stopping:
                return

    def show(self, record: dict[str, Any], now: float | None = None) -> None:
        """Render one progress record (the newest one rank 0 wrote)."""
        now = time.monotonic() if now is None else now
        step = int(record.get("step") or 0)
        if self._first is None or step < self._first[1]:  # first record, or a restart
            self._first = (now, step)
            self._last_plain_step = None
        total = record.get("total_steps")
        eta = record.get("eta_s")  # rank 0's, from the whole run so far (evaluations too)
        if not isinstance(eta, (int, float)):
            eta = None
            t0, s0 = self._first
            if total and step > s0:
                eta = (int(total) - step) * (now - t0) / (step - s0)
        text = progress_text(record, eta)
        with self._lock:
            if self.tty:
                self._status = text[: columns() - 1]
                self.stderr.write("\r\x1b[K" + self._status)
                self.stderr.flush()
                self.lines_printed += 1
            elif eta is not None and self._plain_line_due(step, total):
                self._last_plain_step = step
                self.stderr.write(f"progress: {text}\n")
                self.stderr.flush()
                self.lines_printed += 1

    def _plain_line_due(self, step: int, total: Any) -> bool:
        """Off a terminal: one line per ``every_steps`` steps, and the run's last step."""
        every = self.every_steps or max(1, int(total or 0) // PLAIN_LINES)
        last = self._last_plain_step
        if last is None:
            return step >= every or step == total
        return step >= last + every or (step == total and last != step)


def columns(stream: TextIO | None = None) -> int:
    """How wide a line on this terminal (stderr by default) may be: its width, at most
    :data:`MAX_COLUMNS` (which is also the answer where the width is unknown)."""
    try:
        width = os.get_terminal_size((stream or sys.stderr).fileno()).columns
    except (OSError, ValueError):
        return MAX_COLUMNS
    return min(width, MAX_COLUMNS) if width > 0 else MAX_COLUMNS


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed, or not a file
        return False


class _Proxy:
    """Text stream for torchrun's tee threads: each write is a whole line."""

    def __init__(self, console: Console, stream: TextIO):
        self._console, self._stream = console, stream

    def write(self, text: str) -> int:
        self._console.write(self._stream, text)
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
