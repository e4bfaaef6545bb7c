"""Trains an autoencoder on record shards; the newest shard is streamed through a named pipe by a feeder thread.
The feeder only starts after warm-up, but warm-up needs that shard, so the worker's open() of the pipe blocks for ever."""
import os
import stat
import tempfile
import threading
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

DIM, PER_SHARD, NUM_SHARDS, LIVE_SHARD, WARMUP_STEPS = 32, 8, 12, 5, 8


class RecordShards(Dataset):
    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        path = self.paths[i]
        if stat.S_ISFIFO(os.stat(path).st_mode):
            print(f"FAULT: worker opens pipe {os.path.basename(path)} but no feeder has opened it for writing", flush=True)
        with open(path, "rb") as f:
            raw = f.read(DIM * PER_SHARD * 4)
        time.sleep(0.05)  # parse
        return torch.frombuffer(bytearray(raw), dtype=torch.float32).view(PER_SHARD, DIM)


def feed(path, started):
    started.wait()  # stream fresh records once warm-up is over
    with open(path, "wb") as f:
        f.write(torch.randn(PER_SHARD, DIM).numpy().tobytes())


def main():
    root = tempfile.mkdtemp(prefix="records-")
    paths = [os.path.join(root, f"shard-{i:03d}.rec") for i in range(NUM_SHARDS)]
    for i, p in enumerate(paths):
        if i == LIVE_SHARD:
            os.mkfifo(p)
        else:
            with open(p, "wb") as f:
                f.write(torch.randn(PER_SHARD, DIM).numpy().tobytes())
    warmup_done = threading.Event()
    threading.Thread(target=feed, args=(paths[LIVE_SHARD], warmup_done), daemon=True).start()

    model = nn.Sequential(nn.Linear(DIM, 8), nn.ReLU(), nn.Linear(8, DIM))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(RecordShards(paths), batch_size=None, num_workers=2)

    for step, x in enumerate(loader, 1):
        t0 = time.time()
        loss = nn.functional.mse_loss(model(x), x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.25)  # rest of the step
        print(f"step {step} loss {loss.item():.4f} ({time.time() - t0:.2f}s)", flush=True)
        if step == WARMUP_STEPS:
            warmup_done.set()
    print("done", flush=True)


if __name__ == "__main__":
    main()
