"""Trains a small MLP on shards that a sample writer in the same job keeps appending to.
The writer keeps an exclusive flock on the active shard, so the worker's shared lock on it never comes and no step runs."""
import fcntl
import os
import tempfile
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

DIM, PER_SHARD, NUM_SHARDS = 16, 8, 10


class LockedShards(Dataset):
    """Readers take a shared flock so they never see a half-written shard."""

    def __init__(self, root):
        self.root = root

    def __len__(self):
        return PER_SHARD * NUM_SHARDS

    def __getitem__(self, idx):
        path = os.path.join(self.root, f"shard-{idx // PER_SHARD:03d}.bin")
        with open(path, "rb") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"FAULT: {os.path.basename(path)} is write-locked by the sample writer; worker waits for the lock", flush=True)
                fcntl.flock(f, fcntl.LOCK_SH)
            rec = torch.load(f)
            fcntl.flock(f, fcntl.LOCK_UN)
        time.sleep(0.02)  # augment
        return rec["x"][idx % PER_SHARD], rec["y"][idx % PER_SHARD]


def write_shard(path):
    f = open(path, "wb")
    fcntl.flock(f, fcntl.LOCK_EX)
    torch.save({"x": torch.randn(PER_SHARD, DIM), "y": torch.randn(PER_SHARD, 1)}, f)
    f.flush()
    return f


def main():
    root = tempfile.mkdtemp(prefix="active-shards-")
    for i in range(1, NUM_SHARDS):
        f = write_shard(os.path.join(root, f"shard-{i:03d}.bin"))
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()
    active = write_shard(os.path.join(root, "shard-000.bin"))  # kept open: new samples get appended here

    model = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(LockedShards(root), batch_size=PER_SHARD, num_workers=2)

    for step, (x, y) in enumerate(loader, 1):
        t0 = time.time()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.25)  # rest of the step
        print(f"step {step} loss {loss.item():.4f} ({time.time() - t0:.2f}s)", flush=True)
    active.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
