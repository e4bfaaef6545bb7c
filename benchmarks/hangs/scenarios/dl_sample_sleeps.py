"""Fine-tunes a small regressor on samples fetched from a (simulated) remote object store.
One sample's fetch is rate-limited, and the client honours the server's Retry-After of 3600 s inside the worker."""
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class RemoteStore:
    """Stand-in for an HTTP blob store client: returns (status, headers, payload)."""

    def get(self, key):
        if key == "samples/000021.bin":
            return 429, {"Retry-After": "3600"}, None
        g = torch.Generator().manual_seed(hash(key) % 2**31)
        return 200, {}, torch.randn(24, generator=g)


class RemoteDataset(Dataset):
    def __init__(self, n):
        self.n = n
        self.store = RemoteStore()

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        key = f"samples/{idx:06d}.bin"
        for attempt in range(5):
            status, headers, payload = self.store.get(key)
            if status == 200:
                time.sleep(0.04)  # network latency
                return payload, payload.sum().unsqueeze(0)
            backoff = float(headers.get("Retry-After", 2 ** attempt))
            print(f"FAULT: fetch of {key} rate-limited; backing off {backoff:.0f}s", flush=True)
            time.sleep(backoff)
        raise RuntimeError(f"could not fetch {key}")


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(RemoteDataset(256), batch_size=4, num_workers=2)

    for step, (x, y) in enumerate(loader, 1):
        t0 = time.time()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.25)  # rest of the step
        print(f"step {step} loss {loss.item():.4f} ({time.time() - t0:.2f}s)", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
