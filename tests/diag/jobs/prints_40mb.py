"""Prints 40 MB to stdout (a loop that logs every batch), then one last line, and exits 0."""

import sys

line = b"x" * 1023 + b"\n"
sys.stdout.buffer.write(b"first line\n")
for _ in range(40 * 1024):
    sys.stdout.buffer.write(line)
print("the end", flush=True)
