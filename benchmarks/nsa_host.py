"""How much of the Triton NSA op's forward+backward is the host's: kernels issued per step, the time Python
and autograd take to issue them (no synchronisation) against the synchronised wall time, and a cProfile of
the issuing. When the issue time equals the wall time and the kernels' own time (``nsa_profile.py``) is far
below it, the op is bound by the host: fewer launches or CUDA graphs (``nsa_op.py --graphs``) are the remedy.

    python benchmarks/nsa_host.py --heads 12 --kv-heads 2 --head-dim 64 --seq-lens 2048 16384
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nsa_op import NSAOp, add_geometry_arguments, configure, inputs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--top", type=int, default=18, help="functions of the cProfile listed")
    add_geometry_arguments(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/nsa_host.py needs a CUDA device")
    configure(args)
    torch.manual_seed(0)
    op = NSAOp(args).to(device="cuda", dtype=getattr(torch, args.dtype))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, HQ={args.heads} HKV={args.kv_heads} "
          f"D={args.head_dim} {args.dtype}")  # fmt: skip
    for T in args.seq_lens:
        xs = inputs(args, T)
        do = torch.randn_like(op(*xs))
        for _ in range(5):
            op(*xs).backward(do)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            op(*xs).backward(do)
        issued = (time.perf_counter() - start) / args.steps
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / args.steps
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            op(*xs).backward(do)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in kernels) / 1e3
        print(f"\nT={T}: issue {issued * 1e3:.2f} ms/step, wall {wall * 1e3:.2f} ms/step, "
              f"{len(kernels)} kernels, {busy:.2f} ms in kernels")  # fmt: skip
        for name, count in Counter(e.name[:80] for e in kernels).most_common(12):
            print(f"  {count:3d} x {name}")
        prof_py = cProfile.Profile()
        prof_py.enable()
        for _ in range(10):
            op(*xs).backward(do)
        prof_py.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof_py, stream=text).sort_stats("tottime").print_stats(args.top)
        print(text.getvalue())
        del xs


if __name__ == "__main__":
    main()
