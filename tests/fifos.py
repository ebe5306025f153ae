"""A FIFO that a thread feeds: code that (wrongly) opens it reads `text` and goes on, so a test of a
refusal fails on its assertion instead of hanging for ever on a FIFO without a writer."""
import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def fed_fifo(path: Path, text: str) -> Iterator[Path]:
    """A FIFO at `path` whose every reader gets `text`; its writer stopped on leaving."""
    os.mkfifo(path)
    stop = threading.Event()

    def feed():
        while not stop.is_set():
            with contextlib.suppress(BrokenPipeError), open(path, "w") as f:  # waits for a reader
                f.write(text)
    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        yield path
    finally:
        stop.set()
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # lets the writer's waiting open return
        writer.join()
        os.close(fd)
