"""Peak memory and time of one forward+backward per NSA backend, at several sequence lengths.

Each backend runs with its branch forced (``force_branch``), so the numbers are that branch's own, and each
point runs in a fresh subprocess, so one point's allocations never hide another's peak. On CUDA the peak is
``torch.cuda.max_memory_allocated``; on the CPU it is the rise of the peak resident set size over the
process's size after building the model and inputs. The growth exponent between consecutive lengths is
``log(mem2 / mem1) / log(S2 / S1)``: about 2 for the masked backends, about 1 for the others.

    python benchmarks/backends.py                         # small preset, 1 layer, S = 512 1024 2048, CPU
    python benchmarks/backends.py --device cuda --seq-lens 2048 4096 8192 --preset m7c-125m
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time

CASES = [  # (branch, config field, backend)
    ("sel", "sel_backend", "reference"),
    ("sel", "sel_backend", "masked"),
    ("sel", "sel_backend", "gather"),
    ("sel", "sel_backend", "packed"),
    ("cmp", "cmp_backend", "masked"),
    ("win", "win_backend", "masked"),
    ("win", "win_backend", "chunked"),
]


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure(args: argparse.Namespace) -> dict:
    """One point, in this process: build, warm up, time forward+backward, report time and peak memory."""
    import torch

    import nsa_core

    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}[args.dtype]
    overrides = {"layers": args.layers, "force_branch": args.branch, args.field: args.backend}
    cfg = nsa_core.preset(args.preset, **overrides)
    model = nsa_core.TinyLM(cfg).to(device=device, dtype=dtype)
    tokens = torch.randint(0, cfg.vocab, (args.batch, args.seq_len), device=device)
    if device.type != "cuda":
        import psutil

        # taken before any step: freed CPU memory stays in the process, so a later base would hide the peak
        base = psutil.Process().memory_info().rss

    def step() -> float:
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        sync()
        forward_done = time.perf_counter()
        loss.backward()
        model.zero_grad(set_to_none=True)
        return forward_done

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):  # first calls pay for kernel loading and allocator growth
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    forward_s, total_s = [], []
    for _ in range(args.repeat):
        start = time.perf_counter()
        forward_done = step()
        sync()
        forward_s.append(forward_done - start)
        total_s.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:  # peak RSS cannot be reset: on the CPU it covers the warm-up steps too, which are the same
        peak = _peak_rss_bytes() - base
    return {
        "forward_s": sorted(forward_s)[len(forward_s) // 2],
        "total_s": sorted(total_s)[len(total_s) // 2],
        "peak_bytes": max(peak, 0),
    }


def run_point(args: argparse.Namespace, branch: str, field: str, backend: str, seq_len: int) -> dict:
    cmd = [
        sys.executable, __file__, "--_point",
        "--preset", args.preset, "--layers", str(args.layers), "--batch", str(args.batch),
        "--device", args.device, "--dtype", args.dtype,
        "--warmup", str(args.warmup), "--repeat", str(args.repeat),
        "--branch", branch, "--field", field, "--backend", backend, "--seq-len", str(seq_len),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.point_timeout)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": tail}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="small")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp64"])
    parser.add_argument("--backends", nargs="*", help="subset, e.g. sel:masked win:chunked")
    parser.add_argument("--max-reference-len", type=int, default=1024, help="the per-token reference is slow")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before measuring")
    parser.add_argument("--repeat", type=int, default=3, help="timed steps; the median is reported")
    parser.add_argument("--point-timeout", type=float, default=900.0)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--_point", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--branch", help=argparse.SUPPRESS)
    parser.add_argument("--field", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._point:
        print(json.dumps(measure(args)))
        return

    cases = [c for c in CASES if not args.backends or f"{c[0]}:{c[2]}" in args.backends]
    print(
        f"# preset={args.preset} layers={args.layers} batch={args.batch} device={args.device} "
        f"dtype={args.dtype}; times: median of {args.repeat} forward+backward steps after {args.warmup} "
        "warm-up; growth = d log(mem) / d log(S)",
        flush=True,
    )
    columns = ("branch", "backend", "S", "fwd ms", "fwd+bwd ms", "peak MiB", "growth")
    header = f"{columns[0]:6} {columns[1]:10} " + " ".join(
        f"{c:>{w}}" for c, w in zip(columns[2:], (6, 10, 11, 10, 7), strict=True)
    )
    print(header)
    print("-" * len(header))
    rows = []
    for branch, field, backend in cases:
        previous = None
        for seq_len in args.seq_lens:
            if backend == "reference" and seq_len > args.max_reference_len:
                continue
            point = run_point(args, branch, field, backend, seq_len)
            row = {"branch": branch, "backend": backend, "seq_len": seq_len, **point}
            rows.append(row)
            if "error" in point:
                print(f"{branch:6} {backend:10} {seq_len:>6} error: {point['error']}", flush=True)
                previous = None
                continue
            mib = point["peak_bytes"] / 2**20
            growth = ""
            if previous and previous[1] > 0 and point["peak_bytes"] > 0:
                growth = (
                    f"{math.log(point['peak_bytes'] / previous[1]) / math.log(seq_len / previous[0]):.2f}"
                )
            print(
                f"{branch:6} {backend:10} {seq_len:>6} {point['forward_s'] * 1e3:>10.1f} "
                f"{point['total_s'] * 1e3:>11.1f} {mib:>10.1f} {growth:>7}",
                flush=True,
            )
            previous = (seq_len, point["peak_bytes"])
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    main()
