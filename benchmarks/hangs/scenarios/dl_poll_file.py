"""Trains a small classifier on feature shards written to a local cache dir.
Shard 5 was never produced by the preprocessing job, so the worker that needs it polls for it for ever."""
import os
import tempfile
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

SAMPLES_PER_SHARD = 4
NUM_SHARDS = 16


class ShardDataset(Dataset):
    def __init__(self, root):
        self.root = root

    def __len__(self):
        return SAMPLES_PER_SHARD * NUM_SHARDS

    def __getitem__(self, idx):
        shard = idx // SAMPLES_PER_SHARD
        path = os.path.join(self.root, f"shard-{shard:05d}.pt")
        if not os.path.exists(path):
            print(f"FAULT: shard {shard} is missing; the worker waits for it for ever", flush=True)
        while not os.path.exists(path):
            time.sleep(1)
        data = torch.load(path)
        time.sleep(0.05)  # decode
        return data["x"][idx % SAMPLES_PER_SHARD], data["y"][idx % SAMPLES_PER_SHARD]


def main():
    root = tempfile.mkdtemp(prefix="shards-")
    for shard in range(NUM_SHARDS):
        if shard == 5:  # preprocessing never wrote this one
            continue
        torch.save({"x": torch.randn(SAMPLES_PER_SHARD, 32), "y": torch.randint(0, 4, (SAMPLES_PER_SHARD,))},
                   os.path.join(root, f"shard-{shard:05d}.pt"))

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(ShardDataset(root), batch_size=4, num_workers=2)

    for step, (x, y) in enumerate(loader, 1):
        t0 = time.time()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.25)  # rest of the step
        print(f"step {step} loss {loss.item():.4f} ({time.time() - t0:.2f}s)", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
