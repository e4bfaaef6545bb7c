"""The selection kernels in token tiles or the scan: forward and backward times against one token a program.

`nsa_core.ops.triton.selection` runs its forward and dq kernels over tiles of ``M = rows // G`` query
tokens (``_TILE_ROWS``, 16 by default); ``rows 1`` is one token a program, the kernels as they were before
the tiles (the same outputs bit for bit, the same times: BENCHMARKS.md). For each geometry and input kind,
`triton.testing.do_bench` medians in ms of ``selected_fwd`` and ``selected_bwd`` (dq and dK/dV, the tile
union built inside each), the share of a 2-token tile's slots its union holds, and the largest relative
difference of the outputs and gradients from ``rows 1``. ``random`` selects blocks from independent
random importances (neighbouring queries share only what chance gives); ``smooth`` from importances that
vary slowly along the sequence (knots every 256 tokens), as a trained model's neighbouring queries do;
``model`` (m7c geometries) takes q, k, v and the blocks from layer ``--layer`` of the m7c-125m model at
initialisation on random tokens, the inputs `benchmarks/model_step.py` times.

``--modes`` names what runs: ``rowsR`` token tiles of ``R`` rows (``rows1``: one token a program;
``rowsRturn``: a tile reading its tokens' own blocks reads them in turn, not side by side, ``PAIR_KEYS``),
``scanR`` the scan in tiles of ``R`` rows (``scanR:F,Q``: with ``F`` warps for the forward and ``Q`` for
dq), ``blocks`` the forward and dq by selection block at any length (``blocksh``: parts in bf16;
``blockscC``: ``C`` entries a forward program; ``blocksR:W``: the forward's steps of ``R`` rows on ``W``
warps), ``auto`` what `selection` chooses for the geometry (``SCAN_SPAN``, ``BLOCKS_BYTES``). Token tiles
and the scan run with ``BLOCKS_BYTES = 0``.

    python benchmarks/selection_tiles.py
    python benchmarks/selection_tiles.py --modes rows1 rows16 rows32 --share 60 80
    python benchmarks/selection_tiles.py --geometries "m7c 8x2k" "m7c 16k" --inputs model
    python benchmarks/selection_tiles.py --modes rows16 scan64 scan128 scan128:8,8 auto
    python benchmarks/selection_tiles.py --geometries "m7c 16k" --modes rows16 blocks blocks128:8 auto
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import re
from collections.abc import Iterator

import torch
import triton
from triton.testing import do_bench

from nsa_core.ops.selection import select_blocks
from nsa_core.ops.triton import selection

GEOMETRIES = {  # name: (B, T, HQ, HKV, D)
    "m7c 8x2k": (8, 2048, 12, 2, 64),
    "m7c 4x4k": (4, 4096, 12, 2, 64),
    "m7c 2x8k": (2, 8192, 12, 2, 64),
    "m7c 16k": (1, 16384, 12, 2, 64),
    "m7c 64k": (1, 65536, 12, 2, 64),
    "paper 8k": (1, 8192, 64, 4, 128),
    "paper 64k": (1, 65536, 64, 4, 128),
}


def importance(kind: str, B: int, T: int, HKV: int, ns: int, corr: int = 256) -> torch.Tensor:
    if kind == "random":
        return torch.rand(B, T, HKV, ns, device="cuda")
    knots = torch.rand(B, HKV * ns, T // corr + 2, device="cuda")
    x = torch.nn.functional.interpolate(knots, size=T, mode="linear", align_corners=True)
    x = x.view(B, HKV, ns, T).permute(0, 3, 1, 2)
    return x + 0.05 * torch.rand_like(x)


def model_inputs(B: int, T: int, layer: int) -> list[torch.Tensor]:
    """q, k, v and block_idx of the selection in layer ``layer`` of m7c-125m at initialisation (bf16)."""
    import nsa_core
    from nsa_core.ops.triton import nsa

    cfg = nsa_core.preset("m7c-125m", sel_backend="triton", cmp_backend="triton", win_backend="triton")
    model = nsa_core.TinyLM(cfg).to(device="cuda", dtype=torch.bfloat16)
    seen: list[list[torch.Tensor]] = []
    real = nsa.selected_fwd

    def record(q, k, v, block_idx, *args, **kwargs):
        seen.append([x.detach().clone() for x in (q, k, v, block_idx)])
        return real(q, k, v, block_idx, *args, **kwargs)

    nsa.selected_fwd = record
    try:
        with torch.no_grad():
            model(torch.randint(0, cfg.vocab, (B, T), device="cuda"))
    finally:
        nsa.selected_fwd = real
    return seen[layer]


def measure(q, k, v, do, idx, ls: int) -> tuple[tuple[torch.Tensor, ...], float, float]:
    """Outputs and gradients, and the forward's and backward's times in ms, as `selection` is set now."""
    scale = q.shape[-1] ** -0.5
    o, lse = selection.selected_fwd(q, k, v, idx, ls, 0, scale)
    grads = selection.selected_bwd(do, q, k, v, o, lse, idx, ls, 0, scale)
    fwd = do_bench(lambda: selection.selected_fwd(q, k, v, idx, ls, 0, scale))
    bwd = do_bench(lambda: selection.selected_bwd(do, q, k, v, o, lse, idx, ls, 0, scale))
    return (o, *grads), fwd, bwd


def parse_mode(text: str) -> str:
    m = re.fullmatch(r"auto|rows(\d+)(turn)?|scan(\d+)(:\d+,\d+)?|blocks(h)?(c\d+)?(\d+:\d+)?", text)
    if not m:
        raise argparse.ArgumentTypeError(
            f"{text!r}: rowsR, rowsRturn, scanR, scanR:F,Q, blocks[h][cC][R:W] or auto"
        )
    return text


@contextlib.contextmanager
def configured(mode: str, share: int, span: int) -> Iterator[None]:
    """`selection` set to run ``mode`` (`parse_mode`), put back as it was after."""
    saved = (dict(selection._TILE_ROWS), selection.SHARE_PCT, selection.SCAN_SPAN, selection.SCAN_ROWS,
             dict(selection.PAIR_KEYS), selection.BLOCKS_BYTES, selection.BLOCKS_CHUNK,
             selection.HALF_PARTS, selection.BLOCKS_GROUP)  # fmt: skip
    saved_launch = {key: dict(value) for key, value in selection.LAUNCH.items()}
    selection.SHARE_PCT, selection.SCAN_SPAN = share, span
    if mode.startswith(("rows", "scan")):
        selection.BLOCKS_BYTES = 0
    if mode.startswith("blocks"):
        selection.SCAN_SPAN, selection.BLOCKS_BYTES, selection.BLOCKS_GROUP = 0, 1 << 40, 1 << 10
        half, chunk, launch = re.fullmatch(r"blocks(h)?(?:c(\d+))?(\d+:\d+)?", mode).groups()
        selection.HALF_PARTS = bool(half)
        selection.BLOCKS_CHUNK = int(chunk or saved[6])
        if launch:
            rows, warps = (int(x) for x in launch.split(":"))
            selection.LAUNCH["fwd-blocks"] = dict(BLOCK_R=rows, num_warps=warps)
    elif mode.startswith("rows"):
        rows = int(mode[4:].removesuffix("turn"))
        selection._TILE_ROWS.update(fwd=rows, dq=rows)
        selection.SCAN_SPAN = 0
        if mode.endswith("turn"):
            selection.PAIR_KEYS = {"fwd": False, "dq": False}
    elif mode.startswith("scan"):
        rows, _, warps = mode[4:].partition(":")
        selection.SCAN_ROWS, selection.SCAN_SPAN = int(rows), 1 << 30
        if warps:
            fwd, dq = (int(w) for w in warps.split(","))
            selection.LAUNCH.update({"fwd-scan": dict(num_warps=fwd), "dq-scan": dict(num_warps=dq)})
    try:
        yield
    finally:
        selection._TILE_ROWS.clear()
        selection._TILE_ROWS.update(saved[0])
        (selection.SHARE_PCT, selection.SCAN_SPAN, selection.SCAN_ROWS, selection.PAIR_KEYS,
         selection.BLOCKS_BYTES, selection.BLOCKS_CHUNK, selection.HALF_PARTS,
         selection.BLOCKS_GROUP) = saved[1:]  # fmt: skip
        selection.LAUNCH.clear()
        selection.LAUNCH.update(saved_launch)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--geometries", nargs="+", choices=list(GEOMETRIES), default=list(GEOMETRIES))
    parser.add_argument("--modes", nargs="+", type=parse_mode, default=["rows1", "rows16", "scan128", "auto"])
    parser.add_argument("--share", type=int, nargs="+", default=[selection.SHARE_PCT])
    kinds = ["random", "smooth", "model"]
    parser.add_argument("--inputs", nargs="+", choices=kinds, default=kinds[:2])
    parser.add_argument("--layer", type=int, default=6, help="model inputs: the layer timed")
    args = parser.parse_args()
    today = datetime.date.today().isoformat()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {today}")
    print("sel_block_len 64, n 16 (1 initial, 2 local), bf16")
    ls, n = 64, 16
    span = selection.SCAN_SPAN
    for name in args.geometries:
        B, T, HQ, HKV, D = GEOMETRIES[name]
        for kind in args.inputs:
            torch.manual_seed(0)
            if kind == "model":
                if (HQ, HKV, D) != (12, 2, 64):
                    continue  # the model is m7c-125m's
                q, k, v, idx = model_inputs(B, T, args.layer)
            else:
                q = torch.randn(B, T, HQ, D, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(B, T, HKV, D, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(B, T, HKV, D, device="cuda", dtype=torch.bfloat16)
                imp = importance(kind, B, T, HKV, triton.cdiv(T, ls))
                idx = select_blocks(imp, sel_block_len=ls, n_sel=n, n_init=1, n_local=2).to(torch.int32)
            do = torch.randn_like(q)
            _, count = selection.tile_union(idx, 2)
            line = f"{name:<10} {kind:<6} union {count.float().mean().item() / (2 * n):.2f} |"
            first = None
            for mode in args.modes:
                tiled = mode.startswith("rows") and mode not in ("rows1", "rows1turn")
                for share in args.share if tiled else args.share[:1]:
                    with configured(mode, share, span):
                        outs, fwd, bwd = measure(q, k, v, do, idx, ls)
                    first = first or outs
                    err = max(
                        ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                        for a, b in zip(outs, first, strict=True)
                    )
                    tag = mode + (f"/{share}%" if tiled and len(args.share) > 1 else "")
                    line += f" {tag}: fwd {fwd:.3f} bwd {bwd:.3f} diff {err:.1e} |"
            print(line, flush=True)


if __name__ == "__main__":
    main()
