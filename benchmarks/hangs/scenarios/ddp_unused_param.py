"""DDP training with an auxiliary head whose loss is only added for the first 3 warm-up steps, wrapped
without find_unused_parameters. From step 4 `aux_head` gets no gradient, DDP's reduction never finishes,
and step 5's forward raises on every rank ("Expected to have finished reduction in the prior iteration")."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

AUX_WARMUP_STEPS = 3  # the auxiliary loss only helps early training


class Net(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.Linear(width, width), nn.GELU())
        self.head = nn.Linear(width, 1)
        self.aux_head = nn.Linear(width, 4)  # predicts coarse bins of the target

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.head(h), self.aux_head(h)


def main() -> None:
    nccl = "--nccl" in sys.argv
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if nccl else "gloo", timeout=datetime.timedelta(hours=2))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(Net().to(device), device_ids=[device.index] if nccl else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)  # each rank its own shard
    for step in range(1, 21):
        time.sleep(0.3)  # reading the batch from storage
        x = torch.randn(32, 32, generator=g).to(device)
        y = x.sum(1, keepdim=True)
        bins = torch.bucketize(y.squeeze(1), torch.tensor([-2.0, 0.0, 2.0], device=device))
        out, aux = model(x)
        loss = nn.functional.mse_loss(out, y)
        if step <= AUX_WARMUP_STEPS:
            loss = loss + 0.1 * nn.functional.cross_entropy(aux, bins)
        elif step == AUX_WARMUP_STEPS + 1 and rank == 0:
            print(f"FAULT: aux_head gets no gradient from step {step} (rank {rank}, every rank)", flush=True)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
