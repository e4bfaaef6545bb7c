"""torchrun, gloo: DDP training where rank 0 alone evaluates after step 3 and every rank then meets at a
barrier, as users write it. --eval-s S: the evaluation runs held-out batches for S seconds (rank 1 waits in
the barrier meanwhile); --spin: it never ends (a bug: a loop whose exit condition never comes true)."""

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def evaluate(model: nn.Module, seconds: float, spin: bool) -> int:
    model.eval()
    batches, end = 0, time.time() + seconds
    with torch.no_grad():
        while time.time() < end:
            model(torch.randn(256, 256)).argmax(-1).sum().item()
            batches += 1
    if spin:
        remaining = 1
        while remaining: remaining += 1  # noqa: E701  # fmt: skip
    model.train()
    return batches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--eval-s", type=float, default=10.0)
    parser.add_argument("--spin", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 7):
        loss = model(torch.randn(32, 256)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.2)
        if step == 3:
            if rank == 0:
                print(f"eval: {evaluate(model.module, args.eval_s, args.spin)} batches", flush=True)
            dist.barrier()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
