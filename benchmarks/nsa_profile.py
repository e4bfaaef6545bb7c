"""Where the Triton NSA op's time goes, kernel by kernel: one profiled forward+backward per length.

Builds the op of `benchmarks/nsa_op.py` (same geometry flags), warms it up, then runs ``--steps``
forward+backward passes under ``torch.profiler`` and prints, per CUDA kernel, the time per step and its
share of the step. Use it to pick what to tune; `nsa_op.py` stays the benchmark of record.

    python benchmarks/nsa_profile.py --seq-lens 8192 65536
    python benchmarks/nsa_profile.py --heads 12 --kv-heads 2 --head-dim 64 --seq-lens 16384
    python benchmarks/nsa_profile.py --composed  # the branch functions composed by autograd (earlier path)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nsa_op import ComposedNSAOp, NSAOp, add_geometry_arguments, configure, inputs


def kernel_times(op: NSAOp, xs: list[torch.Tensor], steps: int) -> tuple[dict[str, float], float]:
    """Microseconds per step for each CUDA kernel name, and the step's wall time in ms."""
    do = torch.randn_like(op(*xs))
    for _ in range(3):
        op(*xs).backward(do)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(steps):
            op(*xs).backward(do)
        end.record()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[evt.name] += evt.device_time / steps  # us
    return dict(per_kernel), start.elapsed_time(end) / steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 65536])
    add_geometry_arguments(parser)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--composed", action="store_true", help="the branch functions composed by autograd")
    parser.add_argument("--top", type=int, default=14, help="kernels listed per length")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/nsa_profile.py needs a CUDA device")
    configure(args)
    torch.manual_seed(0)
    op = (ComposedNSAOp if args.composed else NSAOp)(args).to(device="cuda", dtype=getattr(torch, args.dtype))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, HQ={args.heads} HKV={args.kv_heads} "
          f"D={args.head_dim} {args.dtype}")  # fmt: skip
    for T in args.seq_lens:
        xs = inputs(args, T)
        per_kernel, step_ms = kernel_times(op, xs, args.steps)
        total = sum(per_kernel.values())
        print(f"\nT={T}: step {step_ms:.2f} ms wall, {total / 1e3:.2f} ms in kernels")
        for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {us / 1e3:8.3f} ms {100 * us / total:5.1f}%  {name[:90]}")
        del xs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
