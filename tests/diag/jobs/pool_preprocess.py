"""A training loop that tokenizes its next epoch's shards in a multiprocessing Pool (CPU-heavy, 3 s a
shard: --shard-s) while the main process waits in pool.map, as users write it. --stuck: the worker of
shard 1 blocks forever on a lock no one releases (a bug in a tokenizer's cache), so pool.map never
returns."""

import argparse
import threading
import time
from multiprocessing import Pool

import torch
from torch import nn

STUCK = False
SHARD_S = 3.0


def encode(text: str) -> list[int]:
    return [hash(word) % 50257 for word in text.split()]


def tokenize(shard: int) -> tuple[int, int]:
    if STUCK and shard == 1:
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()
    end, tokens = time.time() + SHARD_S, 0
    while time.time() < end:  # the shard's documents
        doc = " ".join(f"w{shard}{i}" for i in range(200))
        tokens += len(encode(doc))
    return shard, tokens


def init(stuck: bool, shard_s: float) -> None:
    global STUCK, SHARD_S
    STUCK, SHARD_S = stuck, shard_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stuck", action="store_true")
    parser.add_argument("--shard-s", type=float, default=3.0)
    args = parser.parse_args()
    model = nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(2):
        with Pool(2, initializer=init, initargs=(args.stuck, args.shard_s)) as pool:
            shards = pool.map(tokenize, range(4 if epoch else 1))
        print(f"epoch {epoch}: {len(shards)} shards", flush=True)
        for _ in range(5):
            model(torch.randn(32, 256)).sum().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.1)


if __name__ == "__main__":
    main()
