"""torchrun, gloo: a small model in DistributedDataParallel, 8 steps, each batch from a DataLoader whose
dataset takes 0.1 s a batch on every rank (a disk) and 0.3 s more on the rank named by --slow-rank
(default 1; -1: none): the other rank waits for it in backward's all-reduce every step. The job runs to
its end."""

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class Samples(Dataset):
    """Random samples; ``delay`` seconds per batch of ``batch`` (a slow disk, a remote store)."""

    def __init__(self, count: int, batch: int, delay: float) -> None:
        self.count, self.per_item = count, delay / batch

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.per_item:
            time.sleep(self.per_item)
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.randn(1, generator=g)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(Net())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = 16
    delay = 0.1 + (0.3 if rank == args.slow_rank else 0.0)
    loader = DataLoader(Samples(batch * args.steps, batch, delay), batch_size=batch)
    for step, (x, y) in enumerate(loader, start=1):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
