"""Data-parallel training with gradients averaged by hand (dist.all_reduce per parameter). Samples with a
missing label are dropped; at step 4 every label of rank 1's batch is missing, so rank 1 skips the step
and waits at a barrier while rank 0 waits for ever in the gradient all_reduce."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn


def load_batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    time.sleep(0.3)  # reading the batch from storage
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(32, 64, generator=g)
    y = x.sum(1, keepdim=True)
    if rank == 1 and step == 4:
        y[:] = float("nan")  # a shard written by a labelling job that failed
    return x.to(device), y.to(device)


def main() -> None:
    nccl = "--nccl" in sys.argv
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if nccl else "gloo", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(1, 21):
        x, y = load_batch(step, rank, device)
        keep = ~y.isnan().squeeze(1)
        x, y = x[keep], y[keep]
        if len(x) == 0:
            print(f"FAULT: rank {rank} skips the gradient all_reduce (empty batch)", flush=True)
            dist.barrier()  # nothing to learn from: just stay in step with the other ranks
            continue
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
