"""torchrun --max-restarts 1, gloo: DDP with a checkpoint each step, as elastic_retry.py; on the first
attempt rank 1's read of its shard in step 3 never returns (the network mount stopped answering), so rank 0
waits for it in DDP's all-reduce. Nothing fails, so torchrun alone would wait for ever. HANG_ALWAYS=1: the
read hangs on every attempt."""

import logging
import os
import tempfile
import threading
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

log = logging.getLogger("train")
STEPS = int(os.environ.get("STEPS", "6"))
HANG_ALWAYS = os.environ.get("HANG_ALWAYS") == "1"


def read_shard(rank: int, step: int, attempt: int) -> torch.Tensor:
    if rank == 1 and step == 3 and (attempt == 0 or HANG_ALWAYS):
        threading.Event().wait()  # the mount stopped answering
    return torch.randn(8, 16)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ckpt = os.path.join(os.environ.get("CKPT_DIR", tempfile.gettempdir()), "elastic_hang.pt")
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = 0
    if attempt and os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.module.load_state_dict(state["model"])
        start = state["step"]
        log.info("rank %d attempt %d resumes at step %d", rank, attempt, start)
    for step in range(start + 1, STEPS + 1):
        x, y = read_shard(rank, step, attempt), torch.randn(8, 1)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "step": step}, ckpt)
        log.info("rank %d step %d loss %.4f", rank, step, loss.item())
        time.sleep(0.3)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
