"""torchrun, gloo: gradients averaged by hand with all_reduce; rank 1 skips it at step 3 (it thinks its
batch was empty) and goes on to a barrier, while rank 0 waits in the all_reduce."""

import os

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 6):
        model(torch.randn(4, 8)).sum().backward()
        empty_batch = rank == 1 and step == 3
        if not empty_batch:
            for p in model.parameters():
                dist.all_reduce(p.grad)
        else:
            dist.barrier()
        opt.step()
        opt.zero_grad()
        print(f"rank {rank} step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
