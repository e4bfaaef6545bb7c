"""Launch options of the Triton NSA kernels, timed one kernel family at a time on the GPU.

For each kernel family (banded forward / dK-dV / dQ, run for the sliding window and the compressed keys;
selection forward / dQ / dK-dV) every candidate of `CANDIDATES` is set through the modules' ``LAUNCH``
overrides while the others keep their defaults, and the launcher that runs it is timed with
``triton.testing.do_bench`` (median ms) at each shape: PERFORMANCE.md's (bf16, 64 query heads, 4 KV heads,
head dim 128) at 8k and 64k, and m7c-125m's (12 / 2 heads, head dim 64) at 16k and at 8 x 2k (its
training step's batch). A candidate that does not
compile (shared memory, registers) is listed as failed. The first row of each family is the default.
Prints the table and, per family, the candidate with the smallest summed time relative to the default.

    python benchmarks/tune_triton.py
    python benchmarks/tune_triton.py --families sel-fwd sel-dkdv --seq-lens 8192
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
from triton.testing import do_bench

from nsa_core.ops.triton import compression, flash, selection
from nsa_core.ops.triton.compression import select_from_lse, triton_compressed_block_select

# (BLOCK_M, BLOCK_N, num_warps, num_stages) for the banded kernels; (num_warps, num_stages[, BLOCK_R]) for
# the selection kernels. None: the default.
BANDED = {
    "fwd": [None, (128, 64, 8, 3), (128, 64, 4, 3), (128, 32, 4, 3), (64, 64, 4, 4), (64, 32, 4, 3)],
    "dkdv": [None, (64, 128, 8, 2), (32, 128, 4, 3), (32, 64, 4, 3), (64, 64, 8, 3), (16, 64, 4, 3),
             (32, 128, 8, 3)],
    "dq": [None, (128, 64, 8, 3), (128, 32, 4, 3), (64, 32, 4, 3), (64, 64, 8, 3), (32, 64, 4, 3),
           (128, 128, 8, 2)],
}  # fmt: skip
SELECTION = {
    "fwd": [None, (2, 2), (2, 3), (4, 2), (4, 4), (8, 3)],
    "dq": [None, (2, 2), (2, 3), (4, 2), (4, 4), (8, 3)],
    "dkdv": [None, (4, 2, 32), (4, 3, 32), (8, 2, 64), (8, 3, 64), (4, 2, 64)],
}
# (BLOCK_M, BLOCK_C, BLOCK_S, num_warps, num_stages) for the importance kernel (compression.LAUNCH)
IMPORTANCE = [
    None, (64, 128, 32, 8, 2), (32, 128, 32, 4, 3), (32, 256, 64, 8, 2), (64, 256, 64, 8, 2),
    (128, 64, 16, 8, 2),
]  # fmt: skip
FAMILIES = (
    [f"{branch}-{kind}" for branch in ("win", "cmp") for kind in BANDED]
    + [f"sel-{kind}" for kind in SELECTION]
    + ["cmp-imp"]
)
SHAPES = {  # name -> (HQ, HKV, D, T, B)
    "G16-8k": (64, 4, 128, 8192, 1),
    "G16-64k": (64, 4, 128, 65536, 1),
    "G6-16k": (12, 2, 64, 16384, 1),
    "G6-8x2k": (12, 2, 64, 2048, 8),  # m7c-125m's training step at 2k (benchmarks/model_step.py)
}
DEVICE, DTYPE = "cuda", torch.bfloat16  # the CPU interpreter checks this script with "cpu", float32
GEOMETRY = dict(block_len=32, block_stride=16, sel_block_len=64, n_sel=16, n_init=1, n_local=2, window=512)


def launch(kind: str, candidate: tuple[int, ...] | None, banded: bool) -> dict[str, int]:
    if candidate is None:
        return {}
    if kind == "importance":
        return dict(zip(("BLOCK_M", "BLOCK_C", "BLOCK_S", "num_warps", "num_stages"), candidate, strict=True))
    if banded:
        return dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), candidate, strict=True))
    return dict(zip(("num_warps", "num_stages", "BLOCK_R"), candidate, strict=False))


def workload(family: str, shape: str) -> Callable[[], object]:
    """The launcher call of one kernel family at one shape (inputs made once)."""
    HQ, HKV, D, T, B = SHAPES[shape]
    branch, kind = family.split("-")
    g = GEOMETRY
    make = dict(device=DEVICE, dtype=DTYPE)
    q = torch.randn(B, T, HQ, D, **make)
    scale = D**-0.5
    if kind == "imp":  # the importance pass and top-n from the compressed branch's lse
        Nc = (T - g["block_len"]) // g["block_stride"] + 1
        k_cmp = torch.randn(B, Nc, HKV, D, **make)
        cmp = dict(block_len=g["block_len"], block_stride=g["block_stride"], q_offset=0)
        _, lse = flash.banded_forward(
            q, k_cmp, k_cmp, key_stride=g["block_stride"], key_offset=g["block_len"] - 1, window=None,
            q_offset=0, scale=scale, compute_o=False,
        )  # fmt: skip
        select = {key: g[key] for key in ("sel_block_len", "n_sel", "n_init", "n_local")}
        return lambda: select_from_lse(q, k_cmp, lse, scale=scale, **cmp, **select)
    if branch in ("win", "cmp"):
        if branch == "win":
            k, v = torch.randn(B, T, HKV, D, **make), torch.randn(B, T, HKV, D, **make)
            geometry = dict(key_stride=1, key_offset=0, window=g["window"], q_offset=0, scale=scale)
        else:
            Nc = (T - g["block_len"]) // g["block_stride"] + 1
            k, v = torch.randn(B, Nc, HKV, D, **make), torch.randn(B, Nc, HKV, D, **make)
            geometry = dict(
                key_stride=g["block_stride"],
                key_offset=g["block_len"] - 1,
                window=None,
                q_offset=0,
                scale=scale,
            )
        if kind == "fwd":
            return lambda: flash.banded_forward(q, k, v, **geometry)
        o, lse = flash.banded_forward(q, k, v, **geometry)
        do = torch.randn_like(q)
        return lambda: flash.banded_backward(do, q, k, v, o, lse, **geometry)
    k, v = torch.randn(B, T, HKV, D, **make), torch.randn(B, T, HKV, D, **make)
    Nc = (T - g["block_len"]) // g["block_stride"] + 1
    k_cmp = torch.randn(B, Nc, HKV, D, **make)
    select = {key: g[key] for key in ("sel_block_len", "n_sel", "n_init", "n_local")}
    block_idx = triton_compressed_block_select(
        q, k_cmp, block_len=g["block_len"], block_stride=g["block_stride"], **select
    )
    if kind == "fwd":
        return lambda: selection.selected_fwd(q, k, v, block_idx, g["sel_block_len"], 0, scale)
    o, lse = selection.selected_fwd(q, k, v, block_idx, g["sel_block_len"], 0, scale)
    do = torch.randn_like(q)
    return lambda: selection.selected_bwd(do, q, k, v, o, lse, block_idx, g["sel_block_len"], 0, scale)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=FAMILIES)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/tune_triton.py needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms (do_bench median), bf16")
    print(f"{'family':<9} {'candidate':<16} " + " ".join(f"{s:>9}" for s in args.shapes) + "  vs default")
    for family in args.families:
        branch, kind = family.split("-")
        banded = branch != "sel"
        module = compression if kind == "imp" else flash if banded else selection
        kind = "importance" if kind == "imp" else kind  # the key of compression.LAUNCH
        candidates = IMPORTANCE if kind == "importance" else (BANDED if banded else SELECTION)[kind]
        calls = {shape: workload(family, shape) for shape in args.shapes}
        base: list[float] | None = None
        best = (1.0, "default")
        for candidate in candidates:
            module.LAUNCH.clear()
            module.LAUNCH[kind] = launch(kind, candidate, banded)
            times = []
            try:
                for shape in args.shapes:
                    times.append(do_bench(calls[shape], warmup=10, rep=40, return_mode="median"))
            except Exception as exc:  # out of shared memory or registers: this candidate cannot run
                print(f"{family:<9} {candidate!s:<16} failed: {type(exc).__name__}: {str(exc)[:60]}")
                continue
            finally:
                module.LAUNCH.clear()
            base = base or times
            rel = sum(t / b for t, b in zip(times, base, strict=True)) / len(times)
            if rel < best[0]:
                best = (rel, str(candidate))
            cells = " ".join(f"{t:>9.3f}" for t in times)
            print(f"{family:<9} {candidate or 'default'!s:<16} {cells}  {rel:.2f}")
        print(f"{family:<9} best: {best[1]} ({best[0]:.2f} of the default)\n")
        del calls
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
