"""The block compressor phi alone: its Triton kernels (`triton_block_compress`, what the fused layer runs)
against the module's torch operations (`BlockCompressor` over `unfold_blocks`), forward and forward+backward
ms (`triton.testing.do_bench` medians), and the Triton backward's time per kernel (us, one profiled pass).

    python benchmarks/compressor.py                       # m7c-125m's (2 KV heads, D=64) and the paper's
    python benchmarks/compressor.py --shapes 65536x4x128  # T x heads x D
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from nsa_core.layers.attention import BlockCompressor
from nsa_core.ops.compression import unfold_blocks
from nsa_core.ops.triton.compressor import triton_block_compress

SHAPES = ["2048x2x64", "16384x2x64", "65536x2x64", "8192x4x128", "65536x4x128"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="T x heads x head dim, B = 1")
    parser.add_argument("--block-len", type=int, default=32)
    parser.add_argument("--block-stride", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/compressor.py needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, l={args.block_len}, "
          f"d={args.block_stride}; ms forward / forward+backward")  # fmt: skip
    for shape in args.shapes:
        print(f"{shape:>12}: {compare(shape, args, dtype)}")


def compare(shape: str, args: argparse.Namespace, dtype: torch.dtype) -> str:
    """One shape's line: both paths' times, and the Triton backward's kernels."""
    T, H, D = (int(x) for x in shape.split("x"))
    geometry = dict(block_len=args.block_len, block_stride=args.block_stride)
    phi = BlockCompressor(args.block_len, D).to(device="cuda", dtype=dtype)
    raw = torch.randn(1, T, H, D, device="cuda", dtype=dtype, requires_grad=True)
    paths = {
        "torch": lambda: phi(unfold_blocks(raw, args.block_len, args.block_stride)),
        "triton": lambda: triton_block_compress(raw, phi.weights(), **geometry),
    }
    dy = torch.randn_like(paths["torch"]())
    leaves = [raw, *phi.parameters()]
    times = {}
    for name, fn in paths.items():
        forward = do_bench(fn, return_mode="median")
        both = do_bench(lambda fn=fn: fn().backward(dy), grad_to_none=leaves, return_mode="median")
        times[name] = f"{forward:.3f} / {both:.3f}"
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        paths["triton"]().backward(dy)
        torch.cuda.synchronize()
    kernels = {
        e.name.removeprefix("_compress_").removesuffix("_kernel"): e.device_time
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name.startswith("_compress")
    }
    split = ", ".join(f"{name} {us:.1f}" for name, us in kernels.items())
    return f"torch {times['torch']}, triton {times['triton']}; triton us: {split}"


if __name__ == "__main__":
    main()
