"""What a training run says while it runs: log lines, the progress bar or lines, MFU (process 0
alone prints; `progress=auto` is a rich bar on a terminal, plain lines otherwise)."""

from __future__ import annotations

import contextlib
import sys

import jax
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ladder_jax import hardware
from ladder_jax.train_config import TrainConfig


def flops_per_token(c, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (matmul params) + causal attention (PaLM's estimate)."""
    matmul_params = c.num_params() - c.vocab_size * c.d_model * (0 if c.tie_embeddings else 1)
    return 6 * matmul_params + 6 * c.n_layers * c.n_heads * c.head_dim * seq_len


def peak_flops(cfg: TrainConfig, device) -> float | None:
    """Dense bf16 FLOP/s of one device (`peak_tflops`, else the hardware table), for MFU."""
    if cfg.peak_tflops:
        return cfg.peak_tflops * 1e12
    chip = hardware.chip_of(device)
    return chip.bf16_flops if chip else None


def duration(seconds: float) -> str:
    """'42.0 s', '4 min 05 s', '2 h 03 min': a wall time for a person."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, sec = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {sec:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def peak_text(peak: dict) -> str:
    """'peak memory 3.21 GB RSS, 1.50 GB per device' (`runtime.peak_memory`'s figures)."""
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    text = f"peak memory {gb(peak['host'])} RSS" if peak["host"] else "peak memory: RSS n/a"
    return text + (f", {gb(peak['device'])} per device" if peak["device"] else "")


class Reporter:
    """Log lines and per-step progress of one run (`cfg.progress`, `cfg.log_every`)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.is_main = jax.process_index() == 0
        self.mode, self._bar, self._task = cfg.progress, None, None

    def log(self, msg: str) -> None:
        if self.is_main:
            if self._bar is not None:
                self._bar.console.print(msg)
            else:
                print(msg, flush=True)

    @contextlib.contextmanager
    def progress(self, start: int):
        """A rich progress bar on a terminal (process 0), plain lines otherwise."""
        mode = self.cfg.progress
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode = mode
        if mode != "bar" or not self.is_main:
            yield
            return
        self._bar = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
        )
        self._task = self._bar.add_task("train", total=self.cfg.steps, completed=start, info="")
        self._bar.start()
        try:
            yield
        finally:
            self._bar.stop()
            self._bar = None

    def row(self, rec: dict, start: int) -> None:
        """Shows one metrics row: on the bar, or as a line every `log_every` steps (and at the
        first step and at each evaluation)."""
        if not self.is_main or self.mode == "none":
            return
        info = f"loss {rec['loss']:.4f}  {rec['tokens_per_s']:,.0f} tok/s"
        if rec.get("eval_loss") is not None:
            info += f"  held-out {rec['eval_loss']:.4f}"
        if self._bar is not None:
            self._bar.update(self._task, completed=rec["step"], info=info)
            if "eval_loss" in rec:
                self._bar.console.print(f"step {rec['step']}: {info}")
        elif (
            rec["step"] % self.cfg.log_every == 0 or "eval_loss" in rec or rec["step"] == start + 1
        ):
            lr, mfu = rec["lr"], rec["mfu"]
            print(
                f"step {rec['step']}/{self.cfg.steps}  {info}  lr {lr:.2e}  grad "
                f"{rec['grad_norm']:.3f}" + (f"  mfu {mfu:.1%}" if mfu else ""),
                flush=True,
            )
