"""Trains a small Transformer encoder with a sequence-length curriculum: the context grows every step.
Healthy: each step does more real compute, so steps get steadily ~3x slower over the run; it finishes and exits 0."""
import time

import torch
import torch.nn as nn

STEPS, BATCH, DIM = 80, 16, 128
START_LEN = 192  # context grows 2.5 tokens a step, to ~2x by the end


def make_batch(seq_len):
    x = torch.randn(BATCH, seq_len, DIM)
    return x, x.roll(1, dims=1)  # predict the previous token's embedding


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one core per job on the shared box
    layer = nn.TransformerEncoderLayer(DIM, nhead=4, dim_feedforward=512, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, num_layers=2), nn.Linear(DIM, DIM))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)

    t_start = time.time()
    for step in range(1, STEPS + 1):
        t0 = time.time()
        seq_len = START_LEN + step * 5 // 2
        x, y = make_batch(seq_len)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} seq_len {seq_len} loss {loss.item():.4f} ({time.time() - t0:.2f}s, {time.time() - t_start:.0f}s total)", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
