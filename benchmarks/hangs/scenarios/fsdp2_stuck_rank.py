"""torchrun, gloo: a model sharded with FSDP2 (fully_shard per block, then the whole model), as users write
it, with a DataLoader-like batch read per step. With --stuck-rank R, rank R's read blocks at step 3 (a file
on a dead mount, here a sleep), while the other ranks go on into step 3's forward and wait in FSDP's
all-gather of the first block's parameters. --device cuda: NCCL, one GPU per rank (LOCAL_RANK)."""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


def read_batch(rank: int, step: int, stuck_rank: int, device: torch.device) -> torch.Tensor:
    if rank == stuck_rank and step == 3:
        print(f"FAULT: rank {rank}'s batch read blocks (a file on a dead mount)", flush=True)
        time.sleep(3600)
    return torch.randn(8, 32, device=device)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stuck-rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(32) for _ in range(3)), nn.Linear(32, 1)).to(device)
    for block in model[:3]:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, args.steps + 1):
        x = read_batch(rank, step, args.stuck_rank, device)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
