"""Trains a small MLP and writes checkpoints asynchronously every 2 steps.
The async writer returns early when the target file already exists and never sets the
"checkpoint finished" event, so the next save waits on it for ever."""
import os
import tempfile
import threading
import time

import torch
import torch.nn as nn

ckpt_dir = tempfile.mkdtemp(prefix="ckpt-")
ckpt_done = threading.Event()
ckpt_done.set()


def write_checkpoint(state, path):
    if os.path.exists(path):
        return  # already written by a previous run: nothing to do
    torch.save(state, path)
    ckpt_done.set()


model = nn.Sequential(nn.Linear(100, 200), nn.Tanh(), nn.Linear(200, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(1, 41):
    x = torch.randn(256, 100)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
    if step % 2 == 0:
        if step == 8:
            print("FAULT: waiting for an async checkpoint whose writer returned without setting the event", flush=True)
        ckpt_done.wait()  # previous async checkpoint must be on disk first
        ckpt_done.clear()
        path = os.path.join(ckpt_dir, f"ckpt-{step // 4}.pt")  # named per 4 steps: two saves share a name
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        threading.Thread(target=write_checkpoint, args=(state, path), name="ckpt-writer").start()
    time.sleep(0.3)
print("done", flush=True)
