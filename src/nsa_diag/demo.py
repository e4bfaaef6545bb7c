"""`python -m nsa_diag.demo` (`make demo`): one training step of the NSA model, with its numbers.

Builds `TinyLM` from a preset (default `tiny`), runs one forward and backward pass on random tokens with a
next-token cross-entropy loss, and prints the configuration, parameter count, logits shape, loss, forward
and backward time, peak memory, and whether every parameter got a finite gradient. Runs on CUDA when it is
available, else on the CPU, where the `tiny` preset takes seconds.

Exit code 0 when every parameter got a finite gradient, 1 when not, 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nsa_diag.errors import UsageError

if TYPE_CHECKING:
    import torch
    from rich.console import Console

    from nsa_core import ModelConfig


@dataclass
class DemoResult:
    """What one forward+backward step measured."""

    preset: str
    cfg: ModelConfig
    device: str
    batch: int
    seq_len: int
    param_count: int
    param_tensors: int
    logits_shape: tuple[int, ...]
    loss: float
    forward_s: float
    backward_s: float
    peak_memory_bytes: int
    peak_memory_kind: str  # what `peak_memory_bytes` measures
    missing_grad: list[str] = field(default_factory=list)
    nonfinite_grad: list[str] = field(default_factory=list)

    @property
    def grads_ok(self) -> bool:
        return not self.missing_grad and not self.nonfinite_grad


def _resolve_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA device here; use --device cpu or auto")
    return torch.device(name)


def _synchronize(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (it includes the torch import)."""
    try:
        import resource
    except ImportError:  # Windows: the current RSS is the closest available figure
        import psutil

        return psutil.Process().memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def run_demo(preset: str = "tiny", batch: int = 2, seq_len: int = 64, device: str = "auto") -> DemoResult:
    """One forward+backward of `TinyLM(nsa_core.preset(preset))` on random tokens `[batch, seq_len]`."""
    import torch
    import torch.nn.functional as F

    import nsa_core

    if batch < 1 or seq_len < 2:
        raise UsageError(f"batch={batch}, seq_len={seq_len}: need batch >= 1 and seq_len >= 2 for a loss")
    cfg = nsa_core.preset(preset)
    dev = _resolve_device(device)
    torch.manual_seed(0)
    model = nsa_core.TinyLM(cfg).to(dev)
    tokens = torch.randint(0, cfg.vocab, (batch, seq_len), device=dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)

    _synchronize(dev)
    start = time.perf_counter()
    logits = model(tokens)  # [B, S, vocab]
    # Next-token loss: position t predicts token t + 1.
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab).float(), tokens[:, 1:].reshape(-1))
    _synchronize(dev)
    forward_s = time.perf_counter() - start

    start = time.perf_counter()
    loss.backward()
    _synchronize(dev)
    backward_s = time.perf_counter() - start

    if dev.type == "cuda":
        peak, peak_kind = torch.cuda.max_memory_allocated(dev), "CUDA max_memory_allocated"
    else:
        peak, peak_kind = _peak_rss_bytes(), "peak RSS of the process, torch import included"

    params = list(model.named_parameters())
    return DemoResult(
        preset=preset,
        cfg=cfg,
        device=str(dev),
        batch=batch,
        seq_len=seq_len,
        param_count=sum(p.numel() for _, p in params),
        param_tensors=len(params),
        logits_shape=tuple(logits.shape),
        loss=loss.item(),
        forward_s=forward_s,
        backward_s=backward_s,
        peak_memory_bytes=peak,
        peak_memory_kind=peak_kind,
        missing_grad=[name for name, p in params if p.grad is None],
        nonfinite_grad=[
            name for name, p in params if p.grad is not None and not bool(torch.isfinite(p.grad).all())
        ],
    )


def _config_rows(preset: str, cfg: ModelConfig) -> list[tuple[str, str]]:
    nsa = cfg.nsa
    return [
        ("preset", preset),
        ("layers / dim / vocab", f"{cfg.layers} / {cfg.dim} / {cfg.vocab}"),
        (
            "heads / kv_heads / head_dim",
            f"{cfg.heads} / {cfg.kv_heads} / {cfg.head_dim} (G={cfg.group_size})",
        ),
        ("compression geometry", f"block_len l={nsa.block_len}, block_stride d={nsa.block_stride}"),
        (
            "selection geometry",
            f"sel_block_len l'={nsa.sel_block_len}, n_sel={nsa.n_sel} "
            f"(forced: n_init={nsa.n_init}, n_local={nsa.n_local})",
        ),
        ("sliding window", f"w={nsa.window}"),
        ("backends", f"cmp={nsa.cmp_backend}, sel={nsa.sel_backend}, win={nsa.win_backend}"),
        ("branches", ", ".join(nsa.branches)),
        ("prefill / gc", f"{cfg.prefill} / {cfg.gc}"),
    ]


def render(result: DemoResult, console: Console) -> None:
    from rich.markup import escape
    from rich.table import Table

    config = Table(title="NSA model", title_justify="left", show_header=False)
    config.add_column(style="bold")
    config.add_column(overflow="fold")
    for key, value in _config_rows(result.preset, result.cfg):
        config.add_row(key, value)
    console.print(config)

    step = Table(
        title="one forward + backward step (the first: one-time warm-up included)",
        title_justify="left",
        show_header=False,
    )
    step.add_column(style="bold")
    step.add_column(overflow="fold")
    step.add_row("device", result.device)
    step.add_row("parameters", f"{result.param_count:,} in {result.param_tensors} tensors")
    step.add_row("tokens", escape(f"[B={result.batch}, S={result.seq_len}] random ids"))
    step.add_row("logits shape", escape(str(list(result.logits_shape))))
    step.add_row("loss (next-token cross-entropy)", f"{result.loss:.4f}")
    step.add_row("forward time", f"{result.forward_s * 1e3:.1f} ms")
    step.add_row("backward time", f"{result.backward_s * 1e3:.1f} ms")
    step.add_row("peak memory", f"{result.peak_memory_bytes / 2**20:.1f} MiB ({result.peak_memory_kind})")
    console.print(step)

    if result.grads_ok:
        console.print(
            f"[green]ok[/green]: all {result.param_tensors} parameter tensors got a finite gradient"
        )
        return
    if result.missing_grad:
        console.print(f"[red]FAIL[/red]: no gradient for {', '.join(result.missing_grad)}")
    if result.nonfinite_grad:
        console.print(f"[red]FAIL[/red]: non-finite gradient in {', '.join(result.nonfinite_grad)}")


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m nsa_diag.demo",
        description="One forward+backward step of the NSA TinyLM on random tokens, with its numbers.",
    )
    parser.add_argument("--preset", default="tiny", help="model preset (default: tiny)")
    parser.add_argument("--batch", type=int, default=2, help="batch size B (default: 2)")
    parser.add_argument("--seq-len", type=int, default=64, help="sequence length S (default: 64)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: auto")
    parser.add_argument("--debug", action="store_true", help="show the traceback on an error")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from rich.console import Console

    args = _parse_args(argv)
    try:
        result = run_demo(args.preset, args.batch, args.seq_len, args.device)
    except Exception as exc:
        from nsa_diag.app import report_error

        return report_error(exc, debug=args.debug)
    render(result, Console())
    return 0 if result.grads_ok else 1


if __name__ == "__main__":
    sys.exit(main())
