"""A training loop (a DataLoader with two workers) that saves a checkpoint after step 3, waits for the slow
shared storage (`time.sleep`), then waits for its upload thread to say the copy is done; the upload thread
died on an error, so the wait never ends. Written as users write it; imports nothing of nsa-diag."""

import logging
import os
import sys
import tempfile
import threading
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(message)s", stream=sys.stdout)
log = logging.getLogger("train")
STORAGE_S = float(os.environ.get("SLOW_STORAGE_S", "8"))


def upload(path: str, done: threading.Event) -> None:
    log.info("uploading %s", path)
    raise ConnectionError("object store refused the upload")  # dies before done.set()


def main() -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 32), torch.randn(256, 1))
    loader = DataLoader(data, batch_size=32, num_workers=2)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with tempfile.TemporaryDirectory() as folder:
        for step, (x, y) in enumerate(loader, start=1):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            log.info("step %d loss %.4f", step, loss.item())
            if step == 3:
                path = os.path.join(folder, "step3.pt")
                torch.save(model.state_dict(), path)
                time.sleep(STORAGE_S)  # the shared filesystem flushes
                uploaded = threading.Event()
                threading.Thread(target=upload, args=(path, uploaded), name="upload").start()
                uploaded.wait()  # never set: the upload thread died
    log.info("training done")


if __name__ == "__main__":
    main()
