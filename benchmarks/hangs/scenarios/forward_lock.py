"""Trains a small model whose forward memoises input projections in a cache guarded by a lock.
The "skip empty batch" early return forgets to release the lock, so the next forward blocks."""
import threading
import time

import torch
import torch.nn as nn


class CachedEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 128)
        self.head = nn.Linear(128, 4)
        self.cache_lock = threading.Lock()
        self.cache = {}

    def forward(self, x, batch_id):
        self.cache_lock.acquire()
        if x.shape[0] == 0:
            print("FAULT: empty batch skipped without releasing the cache lock", flush=True)
            return None  # skip empty batch
        h = torch.relu(self.proj(x))
        self.cache[batch_id % 8] = h.detach().mean(0)
        self.cache_lock.release()
        return self.head(h)


def batches():
    step = 0
    while True:
        step += 1
        n = 0 if step == 4 else 64  # the loader can yield an empty tail batch
        yield step, torch.randn(n, 32), torch.randint(0, 4, (n,))


model = CachedEncoder()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step, x, y in batches():
    if step > 60:
        break
    out = model(x, step)
    if out is None:
        print(f"step {step} skipped (empty batch)", flush=True)
        continue
    loss = nn.functional.cross_entropy(out, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
    time.sleep(0.3)
print("done", flush=True)
