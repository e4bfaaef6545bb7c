"""DDP training whose world size comes from an old config written for a four-GPU machine, started by
torchrun with two ranks: init_process_group(world_size=4) waits for ever for ranks 2 and 3, before any
step runs."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

CONFIG = {"world_size": 4, "lr": 1e-3, "steps": 20}  # from configs/4gpu.yaml


def main() -> None:
    nccl = "--nccl" in sys.argv
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if nccl else torch.device("cpu")
    backend = "nccl" if nccl else "gloo"
    if nccl:
        torch.cuda.set_device(device)
    rank = int(os.environ["RANK"])
    if rank == 0:
        print(f"FAULT: world_size {CONFIG['world_size']} under 2 ranks (rank {rank}, every rank)", flush=True)
    timeout = datetime.timedelta(hours=2)
    dist.init_process_group(backend, world_size=CONFIG["world_size"], rank=rank, timeout=timeout)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1)).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=CONFIG["lr"])
    g = torch.Generator().manual_seed(rank)  # each rank its own shard
    for step in range(1, CONFIG["steps"] + 1):
        time.sleep(0.3)  # reading the batch from storage
        x = torch.randn(32, 64, generator=g).to(device)
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
