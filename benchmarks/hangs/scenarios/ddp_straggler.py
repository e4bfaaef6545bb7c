"""DDP training of a small token model on data sharded by document length: rank 1's shard holds the long
documents, so its batches are padded to four times the length and every step takes it about four times the compute;
rank 0 waits for it in backward's all-reduce each step. Healthy: 25 steps, exits 0."""

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

SHARD_MAX_LEN = [1024, 4096]  # shards split by document length: shard 1 got the long documents


class TokenMLP(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((x + self.mlp(x)).mean(1))


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
    seq_len = SHARD_MAX_LEN[rank]  # every batch padded to its shard's longest document
    for step in range(1, 26):
        x = torch.randn(16, seq_len, 64, generator=g).to(device)
        y = x[:, :, 0].mean(1, keepdim=True)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
