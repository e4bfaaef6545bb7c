"""Trains a small MLP over data shards that an upstream job drops into a staging folder.
After shard 3 the loop polls for the next shard, which the upstream job never writes."""
import os
import tempfile
import time

import torch
import torch.nn as nn

staging = tempfile.mkdtemp(prefix="shards-")
for k in range(4):  # the upstream job has produced shards 0..3 so far
    torch.save(torch.randn(64, 48), os.path.join(staging, f"shard_{k}.pt"))

model = nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 48))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
step = 0
for shard in range(16):
    path = os.path.join(staging, f"shard_{shard}.pt")
    if not os.path.exists(path):
        print(f"FAULT: waiting for {path}, which is never written", flush=True)
    while not os.path.exists(path):
        time.sleep(1)
    data = torch.load(path)
    step += 1
    loss = (model(data) - data).pow(2).mean()  # autoencoder
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} shard {shard} loss {loss.item():.4f}", flush=True)
    time.sleep(0.3)
print("done", flush=True)
