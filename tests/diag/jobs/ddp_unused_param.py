"""torchrun, gloo (--nccl: NCCL on one GPU per rank): a small model with an auxiliary head whose output
the loss never uses, wrapped in DistributedDataParallel without find_unused_parameters. The aux head's
parameters get no gradient, so DDP's reduction of step 1 never finishes: step 2's forward raises on every
rank ("Expected to have finished reduction in the prior iteration ...")."""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


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
        self.aux_head = nn.Linear(width, 4)  # for an auxiliary loss the training loop never adds
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h), self.aux_head(h)


def main() -> None:
    nccl = "--nccl" in sys.argv
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if nccl else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(Net().to(device), device_ids=[device.index] if nccl else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, 6):
        x, y = torch.randn(8, 8, device=device), torch.randn(8, 1, device=device)
        out, _aux = model(x)
        loss = nn.functional.mse_loss(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
