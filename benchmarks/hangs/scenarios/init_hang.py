"""Trains a small MLP after fetching the dataset index from the local data service over HTTP.
The data service accepts the connection but never answers, so the job hangs in init before step 1."""
import json
import socket
import threading
import time
import urllib.request

import torch
import torch.nn as nn


def data_service(sock):
    conns = []
    while True:
        conn, _ = sock.accept()
        conns.append(conn)  # the handler pool is exhausted: the request is never read


server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(8)
threading.Thread(target=data_service, args=(server,), name="data-service", daemon=True).start()
index_url = f"http://127.0.0.1:{server.getsockname()[1]}/datasets/toy/index.json"

print(f"fetching dataset index from {index_url}", flush=True)
print("FAULT: the data service accepts the connection but never answers", flush=True)
with urllib.request.urlopen(index_url) as resp:
    index = json.load(resp)
n_samples = index["num_samples"]

data = torch.randn(n_samples, 32)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, 31):
    batch = data[torch.randint(0, n_samples, (64,))]
    loss = (model(batch) - batch).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
    time.sleep(0.3)
print("done", flush=True)
