"""The writer process's wire format (wire.py): framing over a real SEQPACKET socket pair, and
the child refusing a Start of another version."""

import os
import socket
import threading

from nemo_memlog.config import LoggerConfig, resolve
from nemo_memlog.writers import child, wire


def _pair():
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def test_small_and_large_messages_arrive_whole_and_labelled():
    ours, theirs = _pair()
    big = wire.Log({f"memory/key_{i}": float(i) for i in range(5000)}, 7)  # several CHUNKs
    small = wire.Flush(3, 1.5)
    sender = threading.Thread(target=lambda: [ours.sendall(part) for m in (big, small) for part in wire.encode(m)])
    sender.start()
    receiver = wire.Receiver(theirs)
    assert len(wire.encode(big)) > 1 and len(wire.encode(small)) == 1
    assert receiver.receive() == big and receiver.receive() == small
    sender.join()
    ours.shutdown(socket.SHUT_WR)
    assert receiver.receive() is wire.EOF
    ours.close()
    theirs.close()


def test_the_child_refuses_a_start_of_another_version():
    ours, theirs = _pair()
    settings = resolve(LoggerConfig(tensorboard_dir="unused")).to_plain()
    for part in wire.encode(wire.Start(wire.VERSION + 1, settings, ["tensorboard"], {}, [], {})):
        ours.sendall(part)
    served = threading.Thread(target=child.serve, args=(theirs, os.getpid()))
    served.start()
    served.join(10)
    assert not served.is_alive(), "the child ends at once"
    theirs.close()
    ours.settimeout(1)
    assert ours.recv(wire.CHUNK + 1) == b"", "nothing sent back: no backend was opened, no Goodbye"
    ours.close()
