"""torchrun, gloo: each rank trains one epoch on its own files (files[rank::world], sharded by hand as many
users do) with a DataLoader worker and DDP. Rank 1's files hold fewer batches: it finishes its epoch, saves
its checkpoint and exits while rank 0 is still in the next step's gradient all-reduce."""

import logging
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

FILES = [48, 48, 48, 16]  # samples per file: rank 0 reads files 0 and 2 (6 batches), rank 1 files 1 and 3 (4)
log = logging.getLogger("train")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    samples = sum(FILES[rank::world])
    data = TensorDataset(torch.randn(samples, 16), torch.randn(samples, 1))
    loader = DataLoader(data, batch_size=16, shuffle=True, num_workers=1)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = 0
    for step, (x, y) in enumerate(loader, 1):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.info("rank %d step %d loss %.4f", rank, step, loss.item())
        time.sleep(0.3)
    checkpoints = os.environ.get("CKPT_DIR", tempfile.gettempdir())
    torch.save(model.module.state_dict(), os.path.join(checkpoints, f"rank{rank}.pt"))
    log.info("rank %d done after %d steps", rank, step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
