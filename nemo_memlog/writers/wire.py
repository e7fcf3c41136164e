"""The writer process's wire format: what the training process (parent.py) and the writer
process (child.py) say to each other over one AF_UNIX SOCK_SEQPACKET socket pair.

Pure encoding and decoding, no policy. Each message is one of the labelled tuples below,
pickled, and sent as socket messages of at most ``CHUNK + 1`` bytes: a flag byte (``MORE``:
another part follows; ``LAST``: the message ends here) and up to ``CHUNK`` bytes of the
pickle. A SEQPACKET message arrives whole or not at all, so a one-part message (every step
of ordinary size) is either handed over or still the sender's.

The conversation, version ``VERSION``::

    parent -> child   Start   first, once: the settings (Settings.to_plain()), the backends,
                              the params to record, the secrets and the private environment
                      Log     a step
                      Flush   answered by a Reply (True when every backend drained)
                      Stats   answered by a Reply (the counts per backend)
                      Close   the close budget; then the parent shuts its end for writing
    child -> parent   Reply   to a Flush or Stats, by its ``ident``
                      Warned  a notice the child logged (its level, its text), logged in the parent
                      Goodbye the final counts, after every backend closed

The child refuses a Start whose ``version`` is not its own (a different nemo_memlog on its
path): it ends at once, and the parent warns that the writer process ended.
"""

from __future__ import annotations

import pickle
import socket
from typing import Any, NamedTuple

VERSION = 1
CHUNK = 32 * 1024  # bytes of pickle per socket message; a larger message is sent in several
MORE, LAST = b"\x01", b"\x00"
#: What ``Receiver.receive`` returns once the other end has shut its side.
EOF = None


class Start(NamedTuple):
    version: int
    settings: dict  # Settings.to_plain()
    backend_names: list
    params: dict
    secrets: list
    private_environ: dict  # the variables kept off the child's exec-time environment


class Log(NamedTuple):
    metrics: dict
    step: int


class Flush(NamedTuple):
    ident: int
    timeout_s: float


class Stats(NamedTuple):
    ident: int


class Close(NamedTuple):
    budget_s: float


class Reply(NamedTuple):
    ident: int
    value: object


class Warned(NamedTuple):
    category: str  # the level of the notice ("WARNING")
    text: str


class Goodbye(NamedTuple):
    stats: dict


def encode(message: object) -> list[bytes]:
    """``message`` pickled, as socket messages of at most CHUNK + 1 bytes (a flag byte each).
    Raises what pickle raises (a value that cannot be pickled)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) <= CHUNK:
        return [LAST + data]
    parts = [data[start : start + CHUNK] for start in range(0, len(data), CHUNK)]
    return [MORE + part for part in parts[:-1]] + [LAST + parts[-1]]


class Receiver:
    """Whole messages from a SEQPACKET socket: ``receive()`` returns one, or EOF."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._parts: list[bytes] = []

    def receive(self) -> Any:
        """The next message, or EOF. Raises socket.timeout / BlockingIOError as the socket is set,
        OSError when it breaks."""
        while True:
            chunk = self.sock.recv(CHUNK + 1)
            if not chunk:
                return EOF
            self._parts.append(chunk[1:])
            if chunk[:1] == LAST:
                data, self._parts = b"".join(self._parts), []
                return pickle.loads(data)
