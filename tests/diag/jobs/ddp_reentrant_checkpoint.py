"""torchrun, gloo (--nccl: NCCL on one GPU per rank): activation checkpointing with the reentrant
implementation (torch.utils.checkpoint(..., use_reentrant=True), the old default many training scripts
still pass) inside a DistributedDataParallel model with find_unused_parameters=True, which the script
turned on for its optional auxiliary head. Under reentrant checkpointing DDP's search for unused
parameters cannot see into the checkpointed blocks (their forward runs without autograd), marks their
parameters ready at the end of forward, and the recompute in backward marks them ready again: step 1's
backward raises on every rank ("Expected to mark a variable ready only once ...")."""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=True)
        return self.head(h)


def main() -> None:
    nccl = "--nccl" in sys.argv
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if nccl else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        Net().to(device), device_ids=[device.index] if nccl else None, find_unused_parameters=True
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, 6):
        x, y = torch.randn(8, 8, device=device), torch.randn(8, 1, device=device)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
