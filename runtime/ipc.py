"""Typed ZMQ channels between the server, scheduler and detokenizer processes.

Each channel is PUSH -> PULL over an `ipc://` socket file in a private 0700 temp dir made per launch; the
receiving side binds, senders connect (ZMQ queues messages sent before the peer is up). A `Sender` encodes
`runtime.messages` Structs with msgpack; a `Receiver` decodes them as the channel's tagged union. No pickle.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, NamedTuple

import zmq
import zmq.asyncio

from runtime.messages import Codec, Msg


class Endpoints(NamedTuple):
    """One launch's socket addresses (plain strings: they travel to spawned children in a dict)."""

    scheduler: str  # server -> scheduler: ToScheduler
    detokenizer: str  # scheduler -> detokenizer: ToDetokenizer
    tokenizer: str  # detokenizer and scheduler -> server: ToTokenizer
    ready: str  # children -> parent, once at startup: ReadyMsg

    @classmethod
    def create(cls) -> tuple[Endpoints, str]:
        """Fresh endpoints in a new private dir (mode 0700); returns them and the dir to remove at exit."""
        d = tempfile.mkdtemp(prefix="radixgen-")
        os.chmod(d, 0o700)
        return cls(*(f"ipc://{os.path.join(d, name)}" for name in cls._fields)), d


def remove_ipc_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class Sender:
    """PUSH side of a channel. `send` never blocks (unbounded high-water mark)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, union: Any, bind: bool = False) -> None:
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 2000)
        (self._sock.bind if bind else self._sock.connect)(endpoint)
        self._codec = Codec(union)

    def send(self, msg: Msg) -> None:
        self._sock.send(self._codec.encode(msg), copy=False)

    def close(self, linger_ms: int | None = None) -> None:
        self._sock.close(linger=linger_ms)


class Receiver:
    """Blocking PULL side of a channel; binds by default."""

    def __init__(self, ctx: zmq.Context, endpoint: str, union: Any, bind: bool = True) -> None:
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        (self._sock.bind if bind else self._sock.connect)(endpoint)
        self._codec = Codec(union)

    def recv(self, timeout_ms: int | None = None) -> Any | None:
        """Next message, waiting up to timeout_ms (None: forever); None on timeout."""
        if timeout_ms is not None and not self._sock.poll(timeout_ms, zmq.POLLIN):
            return None
        return self._codec.decode(self._sock.recv(copy=False).buffer)

    def drain(self) -> list[Any]:
        """Every message already queued, without waiting."""
        out: list[Any] = []
        while True:
            try:
                data = self._sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            out.append(self._codec.decode(data.buffer))

    def close(self) -> None:
        self._sock.close()


class AsyncReceiver:
    """PULL side for an asyncio loop (the TokenizerManager); binds by default."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, union: Any, bind: bool = True) -> None:
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        (self._sock.bind if bind else self._sock.connect)(endpoint)
        self._codec = Codec(union)

    async def recv(self) -> Any:
        data = await self._sock.recv(copy=False)
        return self._codec.decode(data.buffer)

    async def poll(self, timeout_ms: int) -> bool:
        return bool(await self._sock.poll(timeout_ms, zmq.POLLIN))  # type: ignore[call-arg]  # pyzmq's stub drops flags

    def close(self) -> None:
        self._sock.close()
