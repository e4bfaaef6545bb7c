"""A job busy-waiting in Python: its main thread spins on a flag until a line arrives on stdin, then prints
its result. The loop is one line with no call in it: the same innermost frame and line in every sample (a
`pass` on a line of its own is an instruction of that line, which a dump catches now and then). It
registers faulthandler for SIGUSR1 itself."""

import faulthandler
import signal
import sys
import threading

faulthandler.register(signal.SIGUSR1, all_threads=True)

told = False


def wait_for_a_line() -> None:
    global told
    sys.stdin.readline()
    told = True


threading.Thread(target=wait_for_a_line, name="stopper", daemon=True).start()
print("ready", flush=True)
while not told: pass  # noqa: E701  # fmt: skip
print("done", flush=True)
