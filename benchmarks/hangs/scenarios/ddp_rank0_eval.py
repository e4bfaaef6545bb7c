"""DDP training of a small token model where rank 0 alone evaluates on a held-out set every 5 steps (about
20 s of forward passes) while rank 1 waits for it in a dist.barrier(). Healthy: 15 steps, exits 0."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

EVAL_EVERY, EVAL_BATCHES = 5, 230


class TokenMLP(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((x + self.mlp(x)).mean(1))


def evaluate(model: nn.Module, device: torch.device) -> float:
    model.eval()
    g = torch.Generator().manual_seed(1234)  # the same held-out set every time
    total = 0.0
    with torch.no_grad():
        for _ in range(EVAL_BATCHES):
            x = torch.randn(32, 1024, 64, generator=g).to(device)
            total += nn.functional.mse_loss(model(x), x[:, :, 0].mean(1, keepdim=True)).item()
    model.train()
    return total / EVAL_BATCHES


def main() -> None:
    nccl = "--nccl" in sys.argv
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if nccl else "gloo", timeout=datetime.timedelta(hours=2))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(TokenMLP().to(device), device_ids=[device.index] if nccl else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)  # each rank its own shard
    for step in range(1, 16):
        time.sleep(0.2)  # reading the batch from storage
        x = torch.randn(16, 512, 64, generator=g).to(device)
        loss = nn.functional.mse_loss(model(x), x[:, :, 0].mean(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if step % EVAL_EVERY == 0:
            if rank == 0:
                print(f"step {step} eval loss {evaluate(model.module, device):.4f}", flush=True)
            dist.barrier()  # the other ranks wait for the evaluation
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
