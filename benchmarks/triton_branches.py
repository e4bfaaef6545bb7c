"""Triton sliding-window and compressed(+selection) branches against SDPA flash and cuDNN, on one GPU.

bf16, B=1, HQ=64, HKV=4, D=128, paper geometry (l=32, d=16, l'=64, n=16, w=512); forward and forward+backward
medians of `triton.testing.do_bench` in ms and the peak memory of one forward+backward, all in one run.

    python benchmarks/triton_branches.py --lengths 2048 8192 16384 32768 65536
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from nsa_core.ops.compression import num_compressed_blocks
from nsa_core.ops.triton.compression import triton_compressed_attention
from nsa_core.ops.triton.window import triton_sliding_window_attention

HQ, HKV, D = 64, 4, 128
L, STRIDE, LSEL, N_SEL, WINDOW = 32, 16, 64, 16, 512


def measure(step: Callable[[], torch.Tensor]) -> tuple[float, float, float]:
    fwd = triton.testing.do_bench(lambda: step())
    both = triton.testing.do_bench(lambda: step().backward())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step().backward()
    torch.cuda.synchronize()
    return fwd, both, (torch.cuda.max_memory_allocated() - base) / 2**20


def ops_at(T: int, dense: bool) -> dict[str, Callable[[], torch.Tensor]]:
    """Each op at sequence length ``T`` as a closure returning a scalar loss."""
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(1, T, HQ, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(1, T, HKV, D, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(1, T, HKV, D, device=dev, dtype=dt, requires_grad=True)
    nc = num_compressed_blocks(T, L, STRIDE)
    kc = torch.randn(1, nc, HKV, D, device=dev, dtype=dt, requires_grad=True)
    vc = torch.randn(1, nc, HKV, D, device=dev, dtype=dt, requires_grad=True)
    select = dict(kv_heads=HKV, sel_block_len=LSEL, n_sel=N_SEL, n_init=1, n_local=2)
    cmp = dict(block_len=L, block_stride=STRIDE)
    ops: dict[str, Callable[[], torch.Tensor]] = {
        "triton window 512": lambda: triton_sliding_window_attention(q, k, v, window=WINDOW).sum(),
        "triton cmp": lambda: triton_compressed_attention(q, kc, vc, **cmp)[0].sum(),
        "triton cmp+select": lambda: triton_compressed_attention(q, kc, vc, select=select, **cmp)[0].sum(),
    }
    if dense:
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        for name, backend in (
            ("sdpa flash", SDPBackend.FLASH_ATTENTION),
            ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
        ):

            def sdpa(backend: SDPBackend = backend) -> torch.Tensor:
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True).sum()

            ops[name] = sdpa
    return ops


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384, 32768, 65536])
    parser.add_argument("--no-dense", action="store_true", help="skip the SDPA baselines (long T)")
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| T | op | fwd ms | fwd+bwd ms | peak MiB |\n|---|---|---|---|---|")
    for T in args.lengths:
        for name, step in ops_at(T, not args.no_dense).items():
            try:
                fwd, both, peak = measure(step)
                print(f"| {T} | {name} | {fwd:.2f} | {both:.2f} | {peak:.0f} |", flush=True)
            except Exception as exc:  # a baseline that does not run here is reported, not fatal
                print(f"| {T} | {name} | failed: {type(exc).__name__}: {str(exc)[:80]} | | |", flush=True)


if __name__ == "__main__":
    main()
