"""The transport between the engine process and its front ends: Unix-domain sockets, MessagePack (msgspec) frames,
as vLLM V1 and SGLang do. The engine binds one ZeroMQ PULL socket every front end PUSHes to: the engine may still be
loading when a front end says Hello, and ZeroMQ queues what is sent before the peer binds. Each front end binds a
stream socket of its own that the engine connects to on its Hello, and writes to without a ZeroMQ I/O thread between
(service/engine/frame_socket.py: the way back is a token's way to its user). Neither side's sends block the engine's
loop: ZeroMQ's send queues are unbounded (SNDHWM 0), the frame socket queues what the kernel cannot take now.
"""

from __future__ import annotations

import os
import sys
import tempfile
import uuid
from dataclasses import dataclass

import msgspec
import zmq

from service.engine.messages import ToEngine, ToFrontEnd


@dataclass(frozen=True)
class Addresses:
    """Where the sockets of one server live: on Linux, names in the abstract namespace (`@...`: no file, so a
    killed server leaves nothing behind); elsewhere, a private directory of Unix sockets."""

    root: str

    @classmethod
    def fresh(cls) -> Addresses:
        if sys.platform == "linux":
            return cls(f"@parley-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        return cls(tempfile.mkdtemp(prefix="parley-ipc-"))

    @property
    def engine(self) -> str:
        return f"ipc://{self.root}/engine"

    def front_end(self, fe: int) -> str:
        return f"ipc://{self.root}/fe{fe}"

    def front_end_frames(self, fe: int) -> str:
        """Front end `fe`'s socket for the engine's messages (service/engine/frame_socket.py)."""
        return f"{self.root}/fe{fe}.frames"

    def remove(self) -> None:
        """The socket files and the directory (the process that made them does, at exit)."""
        if self.root.startswith("@"):
            return
        try:
            for name in os.listdir(self.root):
                os.unlink(os.path.join(self.root, name))
            os.rmdir(self.root)
        except OSError:
            pass


def push(ctx: zmq.Context, address: str) -> zmq.Socket:
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    return s


def pull(ctx: zmq.Context, address: str) -> zmq.Socket:
    s = ctx.socket(zmq.PULL)
    s.setsockopt(zmq.RCVHWM, 0)
    s.setsockopt(zmq.LINGER, 0)
    s.bind(address)
    return s


ENCODER = msgspec.msgpack.Encoder()
TO_ENGINE = msgspec.msgpack.Decoder(ToEngine)
TO_FRONT_END = msgspec.msgpack.Decoder(ToFrontEnd)
