"""The demo model's training loop: AdamW with warmup + cosine, bias balancing, held-out evals, resumable state.

Owns the run directory (train_state.pt, the tokenizer and encoded corpus, loss_curve.png, the exported model),
the step (batch i is a pure function of (seed, i), so stopping and resuming reproduces the same run), periodic
checkpoints and the progress bar. The model is model.py's; the checkpoint format is export.py's.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from moestream.errors import MoestreamError
from moestream.plot import line_chart, pyplot
from moestream.train import data
from moestream.train.model import DemoConfig, DemoK3

STATE = "train_state.pt"


@dataclass
class TrainOptions:
    out_dir: Path  # the defaults below are the shipped demo model's run
    steps: int = 1600
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    decay_steps: int = 150  # warmup-stable-decay: the last decay_steps fall linearly to min_lr_ratio * lr
    weight_decay: float = 0.1
    clip: float = 1.0
    bias_rate: float = 1e-3  # correction-bias step per update (DeepSeek-V3 uses 1e-3)
    seed: int = 0
    text_bytes: int = 10_000_000
    eval_every: int = 100
    eval_windows: int = 64
    checkpoint_seconds: float = 300.0
    threads: int = 1
    model: DemoConfig = field(default_factory=DemoConfig)


@dataclass
class RunState:
    step: int = 0
    losses: list = field(default_factory=list)  # (step, train loss)
    evals: list = field(default_factory=list)  # (step, held-out loss)
    usage: list = field(default_factory=list)  # per MoE layer: expert counts over the last eval interval
    seconds: float = 0.0
    tokens: int = 0


def lr_at(opts: TrainOptions, step: int) -> float:
    """Warmup, then constant, then a linear decay over the last decay_steps. Until the decay starts the rate
    does not depend on opts.steps, so a run resumed with a different --steps is the run launched with it."""
    if step < opts.warmup:
        return opts.lr * (step + 1) / opts.warmup
    start = max(opts.warmup, opts.steps - opts.decay_steps)
    frac = min(1.0, max(0.0, (step - start) / max(1, opts.steps - start)))
    return opts.lr * (1 - (1 - opts.min_lr_ratio) * frac)


def make_optimizer(model: DemoK3, opts: TrainOptions) -> torch.optim.AdamW:
    """Weight decay on matrices only; norms, AttnRes queries, decay parameters and convs are left alone."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "conv1d" not in name and "res_proj" not in name else plain).append(p)
    groups = [{"params": decay, "weight_decay": opts.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=opts.lr, betas=(0.9, 0.95), fused=True)


def lm_loss(model: DemoK3, windows: torch.Tensor) -> torch.Tensor:
    logits = model(windows[:, :-1])  # [B, T, V]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


@torch.no_grad()
def heldout_loss(model: DemoK3, windows: torch.Tensor, batch_size: int = 16) -> float:
    """Mean token cross-entropy over the windows (router counts are restored: evals do not steer balancing)."""
    saved = [m.counts.clone() for m in model.moe_layers()]
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        w = windows[i:i + batch_size]
        total += float(lm_loss(model, w)) * w[:, 1:].numel()
        n += w[:, 1:].numel()
    for m, c in zip(model.moe_layers(), saved):
        m.counts.copy_(c)
    model.train(was_training)
    return total / n


def save_state(path: Path, model: DemoK3, opt: torch.optim.Optimizer, run: RunState, opts: TrainOptions) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "run": asdict(run),
                "options": {**asdict(opts), "out_dir": str(opts.out_dir)}}, tmp)
    os.replace(tmp, path)  # a crash mid-write never leaves a half checkpoint


def load_state(path: Path, model: DemoK3, opt: torch.optim.Optimizer) -> RunState:
    saved = torch.load(path, weights_only=False)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    return RunState(**saved["run"])


def train(opts: TrainOptions, progress: bool = True, stop_after: int | None = None) -> tuple[DemoK3, RunState, Path]:
    """Run (or resume) training to opts.steps; `stop_after` ends early after that many steps of this call
    (for tests and time slices). Returns the model, the run record and the tokenizer directory."""
    torch.set_num_threads(opts.threads)
    out = Path(opts.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus, tok_dir = data.prepare(out, opts.text_bytes, opts.model.vocab_size)
    heldout = data.heldout_windows(corpus.heldout, opts.seq_len, opts.eval_windows)
    model = DemoK3(opts.model, seed=opts.seed)
    opt = make_optimizer(model, opts)
    run = load_state(out / STATE, model, opt) if (out / STATE).is_file() else RunState()
    model.train()
    last_save, end = time.time(), opts.steps if stop_after is None else min(opts.steps, run.step + stop_after)
    bar = tqdm(total=opts.steps, initial=run.step, disable=not progress, file=sys.stderr, mininterval=10,
               desc="train-demo", unit="step")
    window = None
    with StopRequest() as stop:
        while run.step < end and not stop.requested:
            t0 = time.time()
            loss, counts = train_step(model, opt, opts, corpus.train, run.step)
            window = counts if window is None else [a + b for a, b in zip(window, counts)]
            run.seconds += time.time() - t0
            run.tokens += opts.batch_size * opts.seq_len
            run.losses.append((run.step, loss))
            run.step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{run.tokens / max(run.seconds, 1e-9):.0f}", refresh=False)
            if run.step % opts.eval_every == 0 or run.step == opts.steps:
                run.evals.append((run.step, heldout_loss(model, heldout)))
                run.usage, window = [c.tolist() for c in window], None
                bar.write(f"step {run.step}: train {smoothed(run.losses)[-1][1]:.3f}  held-out {run.evals[-1][1]:.3f}")
                write_curve(run, out / "loss_curve.png")
            if time.time() - last_save > opts.checkpoint_seconds or run.step == end:
                save_state(out / STATE, model, opt, run, opts)
                last_save = time.time()
    bar.close()
    if stop.requested:  # only between steps, so the saved state is consistent
        save_state(out / STATE, model, opt, run, opts)
        raise MoestreamError(f"stopped at step {run.step}; the state is saved in {out / STATE}: rerun the same "
                             "command to resume")
    return model, run, tok_dir


class StopRequest:
    """Turns Ctrl-C / SIGTERM during training into a flag the loop checks between steps."""

    def __init__(self) -> None:
        self.requested = False
        self._old: dict = {}

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def train_step(model: DemoK3, opt: torch.optim.Optimizer, opts: TrainOptions, tokens: torch.Tensor,
               step: int) -> tuple[float, list[torch.Tensor]]:
    for group in opt.param_groups:
        group["lr"] = lr_at(opts, step)
    loss = lm_loss(model, data.batch(tokens, step, opts.batch_size, opts.seq_len, opts.seed))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), opts.clip)
    opt.step()
    counts = model.update_bias(opts.bias_rate)  # after the step: the counts are this batch's routing
    return float(loss.detach()), counts


def smoothed(points: list, alpha: float = 0.1) -> list[tuple[float, float]]:
    out, avg = [], None
    for x, y in points:
        avg = y if avg is None else (1 - alpha) * avg + alpha * y
        out.append((x, avg))
    return out


def write_curve(run: RunState, path: Path) -> None:
    """Blue: train loss (EMA); red: held-out loss. Skipped without matplotlib (the `plot` extra): a missing
    chart must not stop a training run."""
    try:
        pyplot()
    except MoestreamError:
        return
    train_pts = smoothed(run.losses)[:: max(1, len(run.losses) // 400)]
    line_chart([train_pts, list(run.evals)], path, labels=["train (EMA)", "held-out"], xlabel="step",
               ylabel="loss")
