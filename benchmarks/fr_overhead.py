"""What switching the flight recorder on (TORCH_FR_BUFFER_SIZE, as `nsa-diag watch` does for a job that has
not set it) costs a collective: run under torchrun, once with the variable and once without.

    torchrun --standalone --nproc-per-node 2 benchmarks/fr_overhead.py            # gloo on the CPU
    TORCH_FR_BUFFER_SIZE=2000 torchrun --standalone --nproc-per-node 2 benchmarks/fr_overhead.py
    torchrun --standalone --nproc-per-node 2 benchmarks/fr_overhead.py --nccl     # one GPU per rank

Rank 0 prints the mean time of one all-reduce of ``--numel`` float32 elements over ``--iters`` calls.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--numel", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=3000)
    parser.add_argument("--nccl", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.nccl else torch.device("cpu")
    if args.nccl:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.nccl else "gloo")
    t = torch.ones(args.numel, device=device)
    for _ in range(100):
        dist.all_reduce(t)
    dist.barrier()
    if args.nccl:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.iters):
        dist.all_reduce(t)
    if args.nccl:
        torch.cuda.synchronize()
    us = (time.perf_counter() - start) / args.iters * 1e6
    if dist.get_rank() == 0:
        recorder = os.environ.get("TORCH_FR_BUFFER_SIZE", "unset")
        print(f"TORCH_FR_BUFFER_SIZE={recorder}: {us:.1f} us per all_reduce of {args.numel * 4} bytes")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
