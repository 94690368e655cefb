"""The controller host's c10d store: ``python -m bootseer.robust.store_host --port 29400``.

Why a process of its own on the controller: torchrun's c10d rendezvous keeps its state in a
TCPStore, and whoever hosts that store is a single point of failure for the job. Hosted here,
on a host that runs no training, a lost training node never takes the rendezvous with it
(``--rdzv-conf is_host=false`` on every node). Prints ``READY <port>`` once the store listens,
serves until SIGTERM/SIGINT or until stdin closes (its parent died).

``bootseer controller --port`` starts it in a session of its own when nothing serves the
port yet: a controller killed with SIGKILL leaves it, with the job's state, to the next one.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bootseer.robust.store_host", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--port", type=int, required=True, help="TCP port to listen on")
    parser.add_argument(
        "--exit-on-stdin-eof",
        action="store_true",
        help="also stop when stdin closes (the parent's lifeline)",
    )
    args = parser.parse_args(argv)
    from torch.distributed import TCPStore

    store = TCPStore(
        "0.0.0.0",
        args.port,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(hours=24),
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.exit_on_stdin_eof:

        def watch() -> None:
            while os.read(0, 65536):
                pass
            stop.set()

        threading.Thread(target=watch, daemon=True).start()
    print(f"READY {store.port}", flush=True)
    while not stop.wait(0.5):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
