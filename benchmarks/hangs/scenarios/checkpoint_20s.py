"""Trains a small MLP and, after step 5, checkpoints it: torch.save locally, then a chunked copy to slow shared storage.
Healthy: the copy takes about 20 s with bytes moving the whole time, then training resumes and the job exits 0."""
import io
import os
import shutil
import tempfile
import time

import torch
import torch.nn as nn

CHUNK = 2 * 1024 * 1024  # 2 MiB
SHARED_BW = 20 * 1024 * 1024  # bytes/s the shared filesystem gives us


def copy_to_shared(src, dst):
    """Throttled, chunked copy (what our NFS mount looks like from the job)."""
    written = 0
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        for i, chunk in enumerate(iter(lambda: fin.read(CHUNK), b"")):
            fout.write(chunk)
            written += len(chunk)
            time.sleep(len(chunk) / SHARED_BW)
            if i % 4 == 3:
                fout.flush()
                os.fsync(fout.fileno())
        fout.flush()
        os.fsync(fout.fileno())
    return written


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    local, shared = tempfile.mkdtemp(prefix="ckpt-local-"), tempfile.mkdtemp(prefix="ckpt-shared-")
    # the EMA / replay buffer that goes into the checkpoint with the model (~320 MiB)
    replay = torch.randn(80 * 1024 * 1024)

    for step in range(1, 11):
        t0 = time.time()
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.25)  # rest of the step
        print(f"step {step} loss {loss.item():.4f} ({time.time() - t0:.2f}s)", flush=True)
        if step == 5:
            t1 = time.time()
            path = os.path.join(local, f"step{step}.pt")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "replay": replay, "step": step}, path)
            n = copy_to_shared(path, os.path.join(shared, os.path.basename(path)))
            print(f"checkpoint step {step}: {n >> 20} MiB in {time.time() - t1:.1f}s", flush=True)
    shutil.rmtree(local)
    shutil.rmtree(shared)
    print("done", flush=True)


if __name__ == "__main__":
    main()
