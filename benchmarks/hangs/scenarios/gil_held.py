"""Trains a tiny LM on token ids a tokenizer thread streams through a pipe, read natively via ctypes.PyDLL.
PyDLL keeps the GIL while read() blocks: when the tokenizer is slow once (reloading its merges table),
the reader holds the GIL the tokenizer needs to write, so no thread can ever run again."""
import ctypes
import ctypes.util
import os
import queue
import threading
import time

import torch
import torch.nn as nn

VOCAB, SEQ, BATCH = 1000, 32, 16
libc = ctypes.PyDLL(ctypes.util.find_library("c"), use_errno=True)  # fast native read path
libc.read.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
libc.read.restype = ctypes.c_ssize_t
rfd, wfd = os.pipe()
requests = queue.Queue()


def tokenizer_service():
    while True:
        step = requests.get()
        if step == 5:
            time.sleep(1.0)  # reload the merges table
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), dtype=torch.int32)
        os.write(wfd, ids.numpy().tobytes())


def read_token_batch():
    nbytes = 4 * BATCH * (SEQ + 1)
    buf = ctypes.create_string_buffer(nbytes)
    got = 0
    while got < nbytes:
        k = libc.read(rfd, ctypes.addressof(buf) + got, nbytes - got)
        got += max(k, 0)
    return torch.frombuffer(bytearray(buf.raw), dtype=torch.int32).view(BATCH, SEQ + 1).long()


threading.Thread(target=tokenizer_service, name="tokenizer-service", daemon=True).start()
model = nn.Sequential(nn.Embedding(VOCAB, 64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, VOCAB))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
requests.put(1)
for step in range(1, 41):
    time.sleep(0.05)  # let the request reach the service
    if step == 5:
        print("FAULT: native read keeps the GIL while waiting for the tokenizer thread", flush=True)
    ids = read_token_batch()
    requests.put(step + 1)  # prefetch the next batch
    logits = model(ids[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
    time.sleep(0.3)
print("done", flush=True)
