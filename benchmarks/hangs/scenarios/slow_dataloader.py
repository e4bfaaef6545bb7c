"""Trains a small CNN on images that the DataLoader workers decode and augment on the CPU (~0.5 s a sample).
Healthy: a few samples are high-resolution scans whose augmentation takes 20-40 s, but the workers keep computing."""
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

DECODE_S = 0.6  # per-sample decode+augment time of our real pipeline, on one core
LARGE = {12, 26}  # indices of the high-resolution scans: ~50x the pixels


class ScanDataset(Dataset):
    def __init__(self, n):
        self.n = n
        self.kernel = torch.tensor([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]]).div(16).expand(3, 1, 3, 3)

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        budget = DECODE_S * (50 if idx in LARGE else 1)
        t0 = time.perf_counter()
        img = torch.rand(1, 3, 128, 128, generator=torch.Generator().manual_seed(idx))
        while time.perf_counter() - t0 < budget:  # stand-in decoder: denoise + contrast passes
            img = F.conv2d(img, self.kernel, padding=1, groups=3)
            img = (img - img.mean()) * 0.99 + 0.5
        img = F.adaptive_avg_pool2d(img, 64)[0]
        return img, idx % 5


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(128, 5))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(ScanDataset(40), batch_size=2, num_workers=2)

    t_start = time.time()
    for step, (x, y) in enumerate(loader, 1):
        t0 = time.time()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.1)  # rest of the step
        print(f"step {step} loss {loss.item():.4f} ({time.time() - t0:.2f}s, {time.time() - t_start:.0f}s total)", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
