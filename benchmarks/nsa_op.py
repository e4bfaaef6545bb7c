"""The full NSA op in Triton against SDPA flash and cuDNN full attention: time and peak memory, one run.

Reproduces the table of ``../shared/PERFORMANCE.md`` with our op added, baselines rerun in the same command:
bf16, B=1, 64 query heads, 4 KV heads (G=16), head dim 128, causal; the paper geometry l=32, d=16, l'=64,
n=16 (1 initial + 2 local forced), w=512. Times are `triton.testing.do_bench` medians in ms, forward and
forward+backward; memory is the peak of ``torch.cuda.max_memory_allocated`` during forward+backward above
what the inputs hold before it (MiB).

The op takes ``q [B, T, HQ, D]``, ``k/v [B, T, HKV, D]`` shared by the three branches and gate logits
``[B, T, HQ, 3]``: compressed keys/values through a learnable phi (an MLP over each block of l tokens,
`nsa_core.layers.attention.BlockCompressor`, run as the model's fused path runs it: its Triton kernels,
keys and values in the same launches, `triton_block_compress_pair`; ``--phi torch``: the module's torch
operations), compressed attention with the importance (Eq. 9, group sum) and top-n fused in
(`triton_compressed_attention(select=...)`), selected attention, sliding window, sigmoid gates
(`triton_gated_sum`: one pass forward, one backward).

    python benchmarks/nsa_op.py                                  # 2k .. 64k, and 256k for ours alone
    python benchmarks/nsa_op.py --seq-lens 8192 65536 --breakdown  # plus each branch's own time
    python benchmarks/nsa_op.py --heads 12 --kv-heads 2 --head-dim 64 --seq-lens 2048 16384  # m7c-125m, G=6
    python benchmarks/nsa_op.py --inputs smooth --composed  # locality; and the branch functions composed
    python benchmarks/nsa_op.py --graphs --heads 12 --kv-heads 2 --head-dim 64 --seq-lens 2048 16384

``--graphs`` also times forward+backward captured in CUDA graphs (`torch.cuda.make_graphed_callables`, one
graph for the forward and one for the backward), ours and cuDNN's, and checks that the graphed op's
output and gradients equal the eager ones bit for bit. At short lengths the eager op is bound by the host
(Python and autograd issue 44 kernels per forward+backward at m7c's geometry and 2k, phi included, in
2.28 ms against 0.49 ms of kernel time: `nsa_host.py`, H200, 2026-12-03); a captured graph replays them
without the host.

The op is `triton_nsa_attention` (one autograd function); ``--composed`` also times the three branch
functions and `triton_gated_sum` composed by autograd, in the same run.

Inputs: ``random`` draws every q/k/v entry independently, so neighbouring queries choose nearly disjoint
blocks, which real NSA attention does not. ``smooth`` draws q and k from a slowly varying process along T
(independent Gaussian knots every ``--corr-len`` tokens, linearly interpolated, plus white noise of
``--noise`` relative size; v stays random): neighbouring queries then share most of their blocks. For each
input kind the table reports the measured overlap: the share of a query's selected blocks its predecessor
(same KV group) selected too, over all slots and over the slots that are not forced (initial and local
blocks), and the distinct blocks a tile of 64 queries reads, per KV group.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from nsa_core.layers.attention import BlockCompressor
from nsa_core.ops.compression import unfold_blocks
from nsa_core.ops.triton import (
    selection,
    triton_compressed_attention,
    triton_gated_sum,
    triton_nsa_attention,
    triton_selected_attention,
    triton_sliding_window_attention,
)
from nsa_core.ops.triton.compressor import triton_block_compress_pair

MIB = 1 << 20


class NSAOp(torch.nn.Module):
    """The full NSA op of PERFORMANCE.md's bar: three branches and their gates over one ``q, k, v``."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.phi_k = BlockCompressor(args.block_len, args.head_dim)
        self.phi_v = BlockCompressor(args.block_len, args.head_dim)

    def branches(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self.args
        k_cmp = self.phi_k(unfold_blocks(k, a.block_len, a.block_stride))
        v_cmp = self.phi_v(unfold_blocks(v, a.block_len, a.block_stride))
        select = dict(kv_heads=a.kv_heads, sel_block_len=a.sel_block_len, n_sel=a.n_sel, n_init=1, n_local=2)
        o_cmp, block_idx = triton_compressed_attention(
            q, k_cmp, v_cmp, block_len=a.block_len, block_stride=a.block_stride, select=select
        )
        o_sel = triton_selected_attention(q, k, v, block_idx, sel_block_len=a.sel_block_len)
        o_win = triton_sliding_window_attention(q, k, v, window=a.window)
        return o_cmp, o_sel, o_win

    def compressed_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """phi of ``k`` and ``v`` as the model's fused path runs it (`triton_block_compress_pair`), or the
        module's torch operations with ``--phi torch``."""
        a = self.args
        if a.phi == "torch":
            k_cmp = self.phi_k(unfold_blocks(k, a.block_len, a.block_stride))
            return k_cmp, self.phi_v(unfold_blocks(v, a.block_len, a.block_stride))
        geometry = dict(block_len=a.block_len, block_stride=a.block_stride)
        return triton_block_compress_pair((k, v), (self.phi_k.weights(), self.phi_v.weights()), **geometry)

    def fused(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The op as one autograd function: ``(out, block_idx)``."""
        a = self.args
        return triton_nsa_attention(
            q, *self.compressed_kv(k, v), k, v, k, v, gate, block_len=a.block_len,
            block_stride=a.block_stride, sel_block_len=a.sel_block_len, n_sel=a.n_sel, n_init=1, n_local=2,
            window=a.window,
        )  # fmt: skip

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.fused(q, k, v, gate)[0]


class ComposedNSAOp(NSAOp):
    """The same op composed by autograd from the branch functions and the gated sum (the earlier path)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return triton_gated_sum(gate, *self.branches(q, k, v))  # sigmoid gates, one pass each way


def sdpa(backend: SDPBackend) -> Callable[..., torch.Tensor]:
    """Causal SDPA on one backend: grouped heads natively where it takes them, else KV heads repeated."""
    native_gqa = [True]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        G = q.shape[2] // k.shape[2]
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
        with sdpa_kernel(backend):
            if native_gqa[0]:
                try:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(
                        1, 2
                    )
                except RuntimeError:
                    native_gqa[0] = False
            k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

    return attend


def smooth(T: int, heads: int, head_dim: int, corr_len: int, noise: float) -> torch.Tensor:
    """``[1, T, heads, head_dim]`` float32 varying slowly along T: Gaussian knots every ``corr_len`` tokens,
    linearly interpolated, rescaled to unit variance, plus white noise of relative size ``noise``."""
    knots = torch.randn(1, heads * head_dim, T // corr_len + 2, device="cuda")
    x = F.interpolate(knots, size=T, mode="linear", align_corners=True)  # [1, H * D, T]
    x = x.transpose(1, 2).reshape(1, T, heads, head_dim)
    x = x / x.std()
    return (x + noise * torch.randn_like(x)) / math.sqrt(1.0 + noise**2)


def inputs(args: argparse.Namespace, T: int) -> list[torch.Tensor]:
    dtype = getattr(torch, args.dtype)
    if args.inputs == "smooth":
        q = smooth(T, args.heads, args.head_dim, args.corr_len, args.noise)
        k = smooth(T, args.kv_heads, args.head_dim, args.corr_len, args.noise)
    else:
        q = torch.randn(1, T, args.heads, args.head_dim, device="cuda")
        k = torch.randn(1, T, args.kv_heads, args.head_dim, device="cuda")
    v = torch.randn(1, T, args.kv_heads, args.head_dim, device="cuda")
    gate = torch.randn(1, T, args.heads, 3, device="cuda")
    return [x.to(dtype).requires_grad_(True) for x in (q, k, v, gate)]


@torch.no_grad()
def block_overlap(op: NSAOp, xs: list[torch.Tensor], tile: int = 64) -> dict:
    """How much neighbouring queries share their selected blocks (see the module docstring)."""
    a = op.args
    _, idx = op.fused(*xs)  # [1, T, HKV, n]
    T = idx.shape[1]
    t = torch.arange(T, device=idx.device)[None, :, None, None]
    own = t // a.sel_block_len
    valid = (idx >= 0) & (idx * a.sel_block_len <= t)
    chosen = valid & (idx >= 1) & (idx <= own - 2)  # neither the initial block nor the 2 local ones
    prev, cur = idx[:, :-1], idx[:, 1:]
    shared = (cur[..., :, None] == prev[..., None, :]).any(-1)  # slot of t found among t-1's slots
    result = {
        "overlap_all": ((shared & valid[:, 1:]).sum() / valid[:, 1:].sum().clamp_min(1)).item(),
        "overlap_chosen": ((shared & chosen[:, 1:]).sum() / chosen[:, 1:].sum().clamp_min(1)).item(),
    }
    # distinct blocks per tile of `tile` queries and KV group: a one-hot of the tile's chosen blocks
    Ns = triton.cdiv(T, a.sel_block_len)
    tiles = triton.cdiv(T, tile)
    hit = torch.zeros(tiles, idx.shape[2], Ns + 1, dtype=torch.bool, device=idx.device)
    tile_of = (t // tile).expand_as(idx)
    head_of = torch.arange(idx.shape[2], device=idx.device)[None, None, :, None].expand_as(idx)
    hit[tile_of[valid], head_of[valid], idx[valid]] = True
    result["tile_blocks"] = hit.sum(-1).float().mean().item()
    return result


def measure(fn: Callable[..., torch.Tensor], xs: list[torch.Tensor], params: list[torch.Tensor]) -> dict:
    """Forward and forward+backward medians (ms) and the peak memory above the inputs (MiB)."""
    grads_of = [*xs, *params]
    do = torch.randn_like(fn(*xs))

    def fwd() -> None:
        with torch.no_grad():
            fn(*xs)

    def fwd_bwd() -> None:
        fn(*xs).backward(do)

    result = {}
    try:
        result["fwd_ms"] = do_bench(fwd, warmup=25, rep=100, return_mode="median")
        result["fwd_bwd_ms"] = do_bench(
            fwd_bwd, grad_to_none=grads_of, warmup=25, rep=100, return_mode="median"
        )
        for x in grads_of:
            x.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd()
        torch.cuda.synchronize()
        result["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / MIB
    except torch.cuda.OutOfMemoryError:
        result["error"] = "OOM"
    for x in grads_of:
        x.grad = None
    torch.cuda.empty_cache()
    return result


class _QKV(torch.nn.Module):
    """An SDPA backend as a module of ``q, k, v`` (make_graphed_callables takes modules or callables whose
    every tensor argument is used)."""

    def __init__(self, backend: SDPBackend) -> None:
        super().__init__()
        self.attend = sdpa(backend)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attend(q, k, v, None)


def _grads(module: torch.nn.Module, xs: list[torch.Tensor], do: torch.Tensor) -> list[torch.Tensor]:
    """Output and the gradients of the inputs and the module's parameters after one forward+backward."""
    params = list(module.parameters())
    for x in [*xs, *params]:
        x.grad = None
    out = module(*xs)
    out.backward(do)
    return [out.detach().clone(), *(x.grad.clone() for x in [*xs, *params])]


def measure_graphed(module: torch.nn.Module, xs: list[torch.Tensor]) -> dict:
    """Forward+backward of a copy of ``module`` captured in CUDA graphs: median ms, and whether its output and
    gradients equal the eager module's bit for bit (same inputs, same ``do``)."""
    do = torch.randn_like(module(*xs))
    graphed_module = copy.deepcopy(module)
    try:
        graphed = torch.cuda.make_graphed_callables(graphed_module, tuple(xs))
        eager, replayed = _grads(module, xs, do), _grads(graphed, xs, do)
        params = list(graphed_module.parameters())

        def fwd_bwd() -> None:
            graphed(*xs).backward(do)

        ms = do_bench(fwd_bwd, grad_to_none=[*xs, *params], warmup=25, rep=100, return_mode="median")
    except torch.cuda.OutOfMemoryError:
        return {"error": "OOM"}
    finally:
        for x in xs:
            x.grad = None
        torch.cuda.empty_cache()
    same = all(torch.equal(a, b) for a, b in zip(eager, replayed, strict=True))
    return {"fwd_bwd_ms": ms, "bitwise_equal": same}


def branch_breakdown(op: NSAOp, xs: list[torch.Tensor]) -> dict:
    """Each branch alone (forward / forward+backward ms): where the op's time goes."""
    q, k, v, _ = xs
    a = op.args
    k_cmp = op.phi_k(unfold_blocks(k, a.block_len, a.block_stride)).detach().requires_grad_(True)
    v_cmp = op.phi_v(unfold_blocks(v, a.block_len, a.block_stride)).detach().requires_grad_(True)
    select = dict(kv_heads=a.kv_heads, sel_block_len=a.sel_block_len, n_sel=a.n_sel, n_init=1, n_local=2)
    geometry = dict(block_len=a.block_len, block_stride=a.block_stride)
    _, block_idx = triton_compressed_attention(
        q.detach(), k_cmp.detach(), v_cmp.detach(), select=select, **geometry
    )
    cases = {
        "cmp": (lambda q, k, v: triton_compressed_attention(q, k_cmp, v_cmp, **geometry)[0]),
        "cmp+select": (
            lambda q, k, v: triton_compressed_attention(q, k_cmp, v_cmp, select=select, **geometry)[0]
        ),
        "sel": (lambda q, k, v: triton_selected_attention(q, k, v, block_idx, sel_block_len=a.sel_block_len)),
        "win": (lambda q, k, v: triton_sliding_window_attention(q, k, v, window=a.window)),
    }
    return {name: measure(fn, [q, k, v], [k_cmp, v_cmp]) for name, fn in cases.items()}


def fmt(r: dict | None) -> str:
    if r is None:
        return "-"
    if "error" in r:
        return r["error"]
    return f"{r['fwd_ms']:.2f} / {r['fwd_bwd_ms']:.1f}"


def fmt_mem(r: dict | None) -> str:
    return "-" if r is None or "error" in r else f"{r['peak_mib']:.0f}"


def add_geometry_arguments(parser: argparse.ArgumentParser) -> None:
    """The op's heads, dtype and NSA geometry (PERFORMANCE.md's by default); shared by the benchmarks."""
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--block-len", type=int, default=32)
    parser.add_argument("--block-stride", type=int, default=16)
    parser.add_argument("--sel-block-len", type=int, default=64)
    parser.add_argument("--n-sel", type=int, default=16)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--inputs", choices=["random", "smooth"], default="random")
    parser.add_argument("--corr-len", type=int, default=256, help="smooth inputs: tokens between knots")
    parser.add_argument("--noise", type=float, default=0.25, help="smooth inputs: relative white noise")
    parser.add_argument(
        "--phi", choices=["triton", "torch"], default="triton",
        help="the fused op's phi: its Triton kernels (the model's fused path) or the module's torch ops",
    )  # fmt: skip
    parser.add_argument(
        "--blocks-bytes", type=int, default=selection.BLOCKS_BYTES,
        help="the selection by selection block up to this workspace (selection.BLOCKS_BYTES; 0: never)",
    )  # fmt: skip
    parser.add_argument(
        "--blocks-group", type=int, default=selection.BLOCKS_GROUP,
        help="... and up to this many query heads a KV group (selection.BLOCKS_GROUP)",
    )  # fmt: skip


def configure(args: argparse.Namespace) -> None:
    """The selection's path options of `add_geometry_arguments`, set for the process: every op runs so."""
    selection.BLOCKS_BYTES, selection.BLOCKS_GROUP = args.blocks_bytes, args.blocks_group


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192, 16384, 32768, 65536, 262144])
    parser.add_argument("--baseline-max", type=int, default=65536, help="no SDPA baselines above this T")
    add_geometry_arguments(parser)
    parser.add_argument("--breakdown", action="store_true", help="also time each branch alone")
    parser.add_argument("--composed", action="store_true", help="also time the branch functions composed")
    parser.add_argument("--graphs", action="store_true", help="also time ours and cuDNN in CUDA graphs")
    parser.add_argument("--json", help="write the results to this file as well")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/nsa_op.py needs a CUDA device")
    configure(args)

    torch.manual_seed(0)
    op = NSAOp(args).to(device="cuda", dtype=getattr(torch, args.dtype))
    composed = ComposedNSAOp(args).to(device="cuda", dtype=getattr(torch, args.dtype))
    composed.load_state_dict(op.state_dict())
    params = list(op.parameters())
    header = {
        "card": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.date.today().isoformat(),
        "geometry": {k: v for k, v in vars(args).items() if k not in ("seq_lens", "json")},
    }
    rows = []
    for seq_len in args.seq_lens:
        xs = inputs(args, seq_len)
        row: dict = {"T": seq_len, "nsa": measure(op, xs, params), "overlap": block_overlap(op, xs)}
        if args.composed:
            row["nsa_composed"] = measure(composed, xs, list(composed.parameters()))
        if seq_len <= args.baseline_max:
            row["sdpa_flash"] = measure(sdpa(SDPBackend.FLASH_ATTENTION), xs, [])
            row["sdpa_cudnn"] = measure(sdpa(SDPBackend.CUDNN_ATTENTION), xs, [])
        if args.breakdown:
            row["branches"] = branch_breakdown(op, xs)
        if args.graphs:
            row["nsa_graphed"] = measure_graphed(op, xs)
            if seq_len <= args.baseline_max:
                row["sdpa_cudnn_graphed"] = measure_graphed(_QKV(SDPBackend.CUDNN_ATTENTION), xs[:3])
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        del xs

    smooth_note = f" (corr-len {args.corr_len}, noise {args.noise})" if args.inputs == "smooth" else ""
    print(f"{header['card']}, torch {header['torch']}, Triton {header['triton']}, {header['date']}, "
          f"{args.dtype}, B=1, HQ={args.heads}, HKV={args.kv_heads}, D={args.head_dim}, l={args.block_len}, "
          f"d={args.block_stride}, l'={args.sel_block_len}, n={args.n_sel}, w={args.window}, "
          f"inputs {args.inputs}{smooth_note}")  # fmt: skip
    print("ms forward / forward+backward; peak MiB of forward+backward above the inputs\n")
    print("| T | SDPA flash | SDPA cuDNN | NSA (ours) | vs cuDNN fwd+bwd | mem flash | mem cuDNN | mem NSA |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        nsa, cudnn = row["nsa"], row.get("sdpa_cudnn")
        speedup = "-"
        if cudnn and "error" not in cudnn and "error" not in nsa:
            speedup = f"{cudnn['fwd_bwd_ms'] / nsa['fwd_bwd_ms']:.2f}x"
        print(
            f"| {row['T'] // 1024}k | {fmt(row.get('sdpa_flash'))} | {fmt(cudnn)} | {fmt(nsa)} | {speedup} | "
            f"{fmt_mem(row.get('sdpa_flash'))} | {fmt_mem(cudnn)} | {fmt_mem(nsa)} |"
        )
    valid = [(r["T"], r["nsa"]["peak_mib"]) for r in rows if "error" not in r["nsa"]]
    if len(valid) >= 2:
        (t0, m0), (t1, m1) = valid[0], valid[-1]
        print(
            f"\nNSA memory exponent {t0 // 1024}k -> {t1 // 1024}k: "
            f"{math.log(m1 / m0) / math.log(t1 / t0):.2f}"
        )
    print(
        "\n| T | NSA fused | NSA composed | mem fused | mem composed | overlap all | overlap chosen | "
        "blocks per 64-query tile |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        ov = row["overlap"]
        print(
            f"| {row['T'] // 1024}k | {fmt(row['nsa'])} | {fmt(row.get('nsa_composed'))} | "
            f"{fmt_mem(row['nsa'])} | {fmt_mem(row.get('nsa_composed'))} | {ov['overlap_all']:.2f} | "
            f"{ov['overlap_chosen']:.2f} | "
            f"{ov['tile_blocks']:.1f} |"
        )
    if args.breakdown:
        print("\n| T | cmp | cmp+select | sel | win |\n|---|---|---|---|---|")
        for row in rows:
            b = row["branches"]
            print(
                f"| {row['T'] // 1024}k | "
                + " | ".join(fmt(b[n]) for n in ("cmp", "cmp+select", "sel", "win"))
                + " |"
            )
    if args.graphs:
        print("\nforward+backward ms, eager and in CUDA graphs (graphed = eager bit for bit: yes/no)\n")
        print("| T | cuDNN eager | cuDNN graphed | NSA eager | NSA graphed | NSA graphed = eager |")
        print("|---|---|---|---|---|---|")
        for row in rows:
            cells = [row.get("sdpa_cudnn"), row.get("sdpa_cudnn_graphed"), row["nsa"], row["nsa_graphed"]]
            ms = ["-" if c is None else c.get("error") or f"{c['fwd_bwd_ms']:.2f}" for c in cells]
            same = row["nsa_graphed"].get("bitwise_equal")
            print(
                f"| {row['T'] // 1024}k | "
                + " | ".join(ms)
                + f" | {'-' if same is None else 'yes' if same else 'no'} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
