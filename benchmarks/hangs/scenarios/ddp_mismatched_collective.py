"""DDP training that syncs its metrics every 4 steps for the log line. The sync helper was half-refactored:
rank 0 all_reduces the metrics while the other ranks still all_gather them (the old histogram logging), so
at step 4 the two ranks sit in different collectives."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def sync_metrics(metrics: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    if rank == 0:
        dist.all_reduce(metrics)  # summed loss and sample count for the log line
        return metrics
    print(f"FAULT: rank {rank} calls all_gather while rank 0 calls all_reduce", flush=True)
    parts = [torch.zeros_like(metrics) for _ in range(world)]
    dist.all_gather(parts, metrics)  # left from the per-rank loss histogram
    return torch.stack(parts).sum(0)


def main() -> None:
    nccl = "--nccl" in sys.argv
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if nccl else "gloo", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1)).to(device)
    model = DDP(net, device_ids=[device.index] if nccl else None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)  # each rank its own shard
    for step in range(1, 21):
        time.sleep(0.3)  # reading the batch from storage
        x = torch.randn(32, 64, generator=g).to(device)
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if step % 4 == 0:
            metrics = torch.stack([loss.detach() * len(x), torch.tensor(len(x), device=device)])
            total = sync_metrics(metrics, rank, world)
            if rank == 0:
                print(f"step {step} mean loss {(total[0] / total[1]).item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
