"""Trains an MLP whose blocked matmul picks its tile size by autotuning on the first step (like a compile warm-up).
Healthy: the first step spends ~90 s of CPU benchmarking tilings (no output), then ~10 normal steps run and it exits 0."""
import itertools
import time

import torch
import torch.nn as nn

TUNE_BUDGET_S = 90.0
_best_tile = {}


def blocked_matmul(a, b, tile):
    out = torch.zeros(a.shape[0], b.shape[1])
    for i in range(0, a.shape[0], tile):
        for j in range(0, b.shape[1], tile):
            out[i:i + tile, j:j + tile] = a[i:i + tile] @ b[:, j:j + tile]
    return out


def autotune(shape):
    """Benchmark candidate tilings, many rounds each, until the tuning budget is spent."""
    if shape in _best_tile:
        return _best_tile[shape]
    a, b = torch.randn(shape[0], shape[1]), torch.randn(shape[1], shape[2])
    timings = {t: [] for t in (4, 8, 16, 32, 64)}
    t_end = time.perf_counter() + TUNE_BUDGET_S
    for tile in itertools.cycle(timings):
        if time.perf_counter() > t_end:
            break
        t0 = time.perf_counter()
        blocked_matmul(a, b, tile)
        timings[tile].append(time.perf_counter() - t0)
    _best_tile[shape] = min(timings, key=lambda t: sorted(timings[t])[len(timings[t]) // 2])
    return _best_tile[shape]


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    print("compiling/autotuning the model (first step is slow)...", flush=True)

    for step in range(1, 11):
        t0 = time.time()
        x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
        tile = autotune((64, 256, 256))
        with torch.no_grad():  # sanity check of the tuned path against nn.Linear
            drift = (blocked_matmul(x, model[0].weight.T, tile) + model[0].bias - model[0](x)).abs().max()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.25)  # rest of the step
        print(f"step {step} tile {tile} loss {loss.item():.4f} drift {drift:.1e} ({time.time() - t0:.2f}s)", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
