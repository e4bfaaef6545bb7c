"""Where an m7c-125m NSA training step spends its GPU time: the kernels of one profiled step, by self time.

One model (Triton branches, bf16, AdamW), 3 warm-up steps, then one step under `torch.profiler`; prints the
step's kernel launches, the GPU time they sum to, the top kernels by GPU time (name, calls, total ms, share)
and the same grouped by the layer's part (selection, compression, window, gates, the rest).

    python benchmarks/step_profile.py --seq-len 2048 --batch 8
    python benchmarks/step_profile.py --seq-len 16384 --batch 1 --composed
    python benchmarks/step_profile.py --dense  # the same model with dense SDPA attention
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import nsa_core

PARTS = (
    ("selection", ("_sel", "selected", "selection", "inverted", "_bucket")),
    ("compression", ("cmp", "compress", "select_from", "_topn", "score")),
    ("banded (win/cmp)", ("banded", "_flash", "_attn_fwd", "_attn_bwd", "dkdv", "_dq")),
    ("gates", ("gate",)),
    ("gemm", ("gemm", "sm90", "cutlass", "nvjet", "Kernel2")),
)


def part_of(name: str) -> str:
    low = name.lower()
    for part, keys in PARTS:
        if any(k in low for k in keys):
            return part
    return "other (elementwise, norms, optimizer)"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--composed", action="store_true")
    parser.add_argument("--dense", action="store_true", help="the same model with dense SDPA attention")
    parser.add_argument("--top", type=int, default=18)
    parser.add_argument("--rows", type=int, help="the selection kernels' token tiles (rows aimed at)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/step_profile.py needs a CUDA device")
    if args.rows is not None:
        from nsa_core.ops.triton import selection

        selection._TILE_ROWS.update(fwd=args.rows, dq=args.rows)
    triton = dict(sel_backend="triton", cmp_backend="triton", win_backend="triton")
    cfg = nsa_core.preset("m7c-125m", **triton, fused=not args.composed)
    model = nsa_core.TinyLM(cfg)
    if args.dense:
        from model_step import DenseAttention  # benchmarks/ is the script's folder

        for block in model.blocks:
            block.attn = DenseAttention(cfg)
    model = model.to(device="cuda", dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, cfg.vocab, (args.batch, args.seq_len + 1), device="cuda")

    def step() -> None:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in kernels:
        by_name[e.name].append(
            e.device_time_total / 1e3 if hasattr(e, "device_time_total") else e.cuda_time_total / 1e3
        )
    total = sum(sum(v) for v in by_name.values())
    mode = "dense" if args.dense else "composed" if args.composed else "fused"
    rows = f" rows {args.rows}" if args.rows is not None else ""
    print(f"S={args.seq_len} B={args.batch} {mode}{rows}: {len(kernels)} kernels, {total:.1f} ms of GPU time")
    rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    for name, times in rows[: args.top]:
        print(f"  {sum(times):8.2f} ms {100 * sum(times) / total:5.1f}% {len(times):5d}x  {name[:90]}")
    parts: dict[str, float] = collections.defaultdict(float)
    for name, times in by_name.items():
        parts[part_of(name)] += sum(times)
    print(
        "  by part: "
        + ", ".join(
            f"{p} {t:.1f} ms ({100 * t / total:.0f}%)"
            for p, t in sorted(parts.items(), key=lambda kv: -kv[1])
        )
    )


if __name__ == "__main__":
    main()
