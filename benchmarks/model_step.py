"""Training step of ``m7c-125m`` with NSA on the Triton backends against the same model with dense attention.

PERFORMANCE.md's model-level bar: tokens/s of a full training step (forward, backward, AdamW) of the seeds'
production model (12 layers, dim 768, 12 heads / 2 KV heads, head dim 64, vocab 50304), bf16 weights, on
one GPU, against the same model whose attention is dense causal SDPA on cuDNN (flash where cuDNN refuses),
measured in one run; and the peak memory of each. The dense model keeps everything but the attention: the
same embedding, RMSNorm, SwiGLU and head; one q projection, one k/v projection, RoPE, SDPA, the output
projection (NSA's three k/v projections, compressors and gates are its own extra parameters).

Each length runs ``--tokens`` tokens a step (batch = tokens / S, at least 1), 3 warm-up steps, then the
median of ``--steps`` timed steps (CUDA events); peak is ``max_memory_allocated`` over the timed steps;
``host ms`` is the median time the host takes to launch a step (no step synchronises): where it is close
to the step time, the step is bound by the host. ``--rounds R`` measures the models in turn R times (a
new model each time): the figures are the medians over the rounds, the ratio the median of the rounds'
own ratios with their range (the ratio moved by +-0.06 between single runs on one kind of machine).

    python benchmarks/model_step.py --seq-lens 2048 16384
    python benchmarks/model_step.py --rounds 3  # dense, NSA, dense, NSA, dense, NSA
    python benchmarks/model_step.py --graphs  # the model's forward and backward in CUDA graphs, both models
    python benchmarks/model_step.py --composed  # also NSA with the branches composed (fused=False)

``--graphs`` captures each model's forward and backward in CUDA graphs (`torch.cuda.make_graphed_callables`
on the model, token ids as its input); the loss and AdamW stay eager. Both models are measured the same
way, so the ratio compares like with like; at short lengths both are bound by the host without graphs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import nsa_core
from nsa_core.layers.attention import apply_rope

GIB = 1 << 30


class DenseAttention(nn.Module):
    """Causal grouped-query attention through SDPA: the dense baseline for `NSAAttention`."""

    def __init__(self, cfg: nsa_core.ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, HKV, D = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, H * D, bias=False)
        self.kv_proj = nn.Linear(cfg.dim, 2 * HKV * D, bias=False)
        self.o_proj = nn.Linear(H * D, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cache: object = None) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        positions = torch.arange(T, device=x.device)
        q = apply_rope(self.q_proj(x).view(B, T, cfg.heads, cfg.head_dim), positions, cfg.rope_theta)
        k, v = self.kv_proj(x).view(B, T, 2, cfg.kv_heads, cfg.head_dim).unbind(2)
        k = apply_rope(k, positions, cfg.rope_theta)
        G = cfg.heads // cfg.kv_heads
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


def build(kind: str, dtype: torch.dtype) -> nn.Module:
    triton = dict(sel_backend="triton", cmp_backend="triton", win_backend="triton")
    cfg = nsa_core.preset("m7c-125m", **triton, fused=kind != "composed")
    model = nsa_core.TinyLM(cfg)
    if kind == "dense":
        for block in model.blocks:
            block.attn = DenseAttention(cfg)
    return model.to(device="cuda", dtype=dtype)


def measure(kind: str, S: int, B: int, steps: int, dtype: torch.dtype, graphs: bool = False) -> dict:
    torch.manual_seed(0)
    model = build(kind, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.cfg.vocab
    tokens = torch.randint(0, vocab, (B, S + 1), device="cuda")
    inputs = tokens[:, :-1].contiguous()
    forward = torch.cuda.make_graphed_callables(model, (inputs,)) if graphs else model

    def step() -> None:
        logits = forward(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    result: dict = {
        "kind": kind,
        "S": S,
        "B": B,
        "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
    }
    try:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times, host = [], []
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            began = time.perf_counter()
            step()
            host.append((time.perf_counter() - began) * 1e3)  # the host's launches (no sync in a step)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        ms = statistics.median(times)
        result |= {
            "step_ms": ms,
            "host_ms": statistics.median(host),
            "tokens_per_s": B * S / ms * 1e3,
            "peak_gib": torch.cuda.max_memory_allocated() / GIB,
        }
    except torch.cuda.OutOfMemoryError:
        result["error"] = "OOM"
    return result


def combined(runs: list[dict]) -> dict:
    """One model's figures over its rounds: medians of the step and host times, the largest peak; an
    error if any round had one."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    step_ms = statistics.median(r["step_ms"] for r in runs)
    return {
        **runs[0],
        "step_ms": step_ms,
        "host_ms": statistics.median(r["host_ms"] for r in runs),
        "tokens_per_s": runs[0]["B"] * runs[0]["S"] / step_ms * 1e3,
        "peak_gib": max(r["peak_gib"] for r in runs),
        "rounds": len(runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 16384])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per step (batch = tokens / S)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1, help="the models measured in turn this many times")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--graphs", action="store_true", help="forward and backward in CUDA graphs")
    parser.add_argument(
        "--composed", action="store_true", help="also NSA with the branches composed, not the fused op"
    )
    parser.add_argument("--json", help="write the results to this file as well")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/model_step.py needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    import triton

    header = {
        "card": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.date.today().isoformat(),
        "graphs": args.graphs,
    }
    print(", ".join(f"{k} {v}" for k, v in header.items()))
    columns = f"{'step ms':>9} {'host ms':>8} {'tokens/s':>10} {'peak GiB':>9}"
    print(f"{'S':>6} {'B':>3}  {'model':<8} {columns}  NSA vs dense")
    kinds = ("dense", "nsa", "composed") if args.composed else ("dense", "nsa")
    rows = []
    for S in args.seq_lens:
        B = max(1, args.tokens // S)
        rounds: dict[str, list[dict]] = {kind: [] for kind in kinds}
        for _ in range(max(1, args.rounds)):
            for kind in kinds:
                rounds[kind].append(measure(kind, S, B, args.steps, dtype, args.graphs))
                torch.cuda.empty_cache()  # the model and optimizer of `measure` are gone
        pair = {kind: combined(runs) for kind, runs in rounds.items()}
        for kind, r in pair.items():
            if "error" in r:
                print(f"{S:>6} {B:>3}  {kind:<8} {r['error']:>9}")
                continue
            ratio = ""
            if kind != "dense" and "error" not in pair["dense"]:
                d = pair["dense"]
                ratio = f"{r['tokens_per_s'] / d['tokens_per_s']:.2f}x tokens/s"
                if len(rounds[kind]) > 1:
                    per_round = sorted(
                        mine["tokens_per_s"] / dense["tokens_per_s"]
                        for mine, dense in zip(rounds[kind], rounds["dense"], strict=True)
                    )
                    median = statistics.median(per_round)
                    r["ratio_rounds"] = per_round
                    ratio = f"{median:.2f}x tokens/s ({per_round[0]:.2f}-{per_round[-1]:.2f} in"
                    ratio += f" {len(per_round)} rounds)"
                ratio += f", {r['peak_gib'] / d['peak_gib']:.2f}x peak"
            figures = f"{r['step_ms']:>9.1f} {r['host_ms']:>8.1f} {r['tokens_per_s']:>10.0f}"
            figures += f" {r['peak_gib']:>9.2f}"
            print(f"{S:>6} {B:>3}  {kind:<8} {figures}  {ratio}")
        rows.append(pair)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**header, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
