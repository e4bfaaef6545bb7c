"""A DDP script whose world size is written into its code for a three-GPU machine, started by torchrun
with two ranks: both wait in init_process_group for a third rank that never comes. Written as users write
it (gloo on the CPU here); imports nothing of nsa-diag."""

import os

import torch
import torch.distributed as dist
from torch import nn

WORLD_SIZE = 3  # from the old three-GPU config


def main() -> None:
    dist.init_process_group("gloo", world_size=WORLD_SIZE, rank=int(os.environ["RANK"]))
    model = nn.parallel.DistributedDataParallel(nn.Linear(16, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        loss = model(torch.randn(4, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
