"""Writes a checkpoint until its disk is full (the file system the job runs on), says so, and exits 0."""

import os

written = 0
with open("checkpoint.bin", "wb", buffering=0) as f:
    try:
        while True:
            written += f.write(b"\0" * 65536)
    except OSError as exc:
        print(f"checkpoint stopped after {written} bytes: {exc.strerror}", flush=True)
os.sync()
