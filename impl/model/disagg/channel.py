"""Hand-offs between two ranks of a torch.distributed process group, point to point.

One hand-off is three messages from the context rank to the generation rank: a size record
(int64 [2]: kind, header bytes), the header (the manifest as UTF-8 JSON) and the payload (uint8, its
size in the manifest). The end of the stream is a size record of kind ``END``. Every tensor lives
on the channel's device: the CPU for gloo, the rank's CUDA device for NCCL, which moves only CUDA
tensors (``EngineConfig.transfer_backend``; the NCCL path is not exercised by the CPU tests).

Each channel records a ``Transfer`` per hand-off it moves (``transfers``): the request, its header
and payload bytes, and the payload's seconds. On the receiving side these run from the header's
arrival to the payload's (the sender sends the three messages back to back, so this is the payload's
time on the link, a wait for the receiver's queue excluded); on CUDA the payload's receive is polled
for completion on the host (``work.is_completed()``, every ``POLL_S``, at most ``POLL_LIMIT_S``), so
the time does not include a wait for the engine's later kernels on the device's default stream. On
the sending side the seconds are the host's time in the three send calls (on CUDA only their
enqueueing).

``Inbox`` receives on a thread of its own into a bounded queue, so a generation engine keeps
stepping while the next hand-off is on its way, and stops receiving (the sender waits) while the
queue is full.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from impl.model.disagg.handoff import Handoff
from impl.model.engine_config import EngineConfig, transfer_backend

HANDOFF, END = 1, 0
POLL_S = 1e-4       # how often a CUDA receive is polled for completion
POLL_LIMIT_S = 5.0  # polled no longer than this (no payload takes as long); then the stream waits


class TransferError(RuntimeError):
    """The stream itself is broken (an unreadable header): no later hand-off can be found in it."""


def open_group(config: EngineConfig, rank: int, world_size: int, init_method: str,
               timeout_s: float = 300.0) -> None:
    """Join the process group of a disaggregated pair with ``config``'s transfer backend."""
    dist.init_process_group(transfer_backend(config), init_method=init_method, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))


@dataclass(frozen=True)
class Transfer:
    """One hand-off moved: its request, header and payload bytes, and seconds (module docstring)."""

    request_id: str
    header_bytes: int
    payload_bytes: int
    seconds: float

    @property
    def bytes(self) -> int:
        return self.header_bytes + self.payload_bytes

    @property
    def payload_bytes_per_second(self) -> float | None:
        """The payload's rate; None without a payload (a request finished in its context step)."""
        if not self.payload_bytes or self.seconds <= 0:
            return None
        return self.payload_bytes / self.seconds


class TransferChannel:
    """Sends hand-offs to, or receives them from, rank ``peer``."""

    def __init__(self, peer: int, device: torch.device | str = "cpu"):
        self.peer = peer
        self.device = torch.device(device)
        self.sent_bytes = 0
        self.received_bytes = 0
        self.transfers: list[Transfer] = []

    def send(self, handoff: Handoff) -> None:
        t0 = time.perf_counter()
        header = torch.frombuffer(bytearray(json.dumps(handoff.manifest).encode()),
                                  dtype=torch.uint8)
        dist.send(torch.tensor([HANDOFF, header.numel()], dtype=torch.int64, device=self.device),
                  self.peer)
        dist.send(header.to(self.device), self.peer)
        dist.send(handoff.payload.to(self.device), self.peer)
        self.sent_bytes += header.numel() + handoff.payload.numel()
        self.transfers.append(Transfer(handoff.request_id, header.numel(), handoff.payload.numel(),
                                       time.perf_counter() - t0))

    def send_end(self) -> None:
        dist.send(torch.tensor([END, 0], dtype=torch.int64, device=self.device), self.peer)

    def receive(self) -> Handoff | None:
        """The next hand-off, or None at the end of the stream."""
        size = torch.empty(2, dtype=torch.int64, device=self.device)
        dist.recv(size, self.peer)
        kind, n = (int(v) for v in size.tolist())
        if kind == END:
            return None
        if kind != HANDOFF or n <= 0:
            raise TransferError(f"a size record of kind {kind} and {n} header bytes from rank "
                                f"{self.peer}: not a hand-off")
        header = torch.empty(n, dtype=torch.uint8, device=self.device)
        dist.recv(header, self.peer)
        try:
            manifest = json.loads(bytes(header.cpu().numpy()).decode())
            payload_bytes = int(manifest["payload_bytes"])
        except (ValueError, KeyError, TypeError) as e:
            raise TransferError(f"an unreadable hand-off header from rank {self.peer}: "
                                f"{e}") from None
        t0 = time.perf_counter()
        payload = torch.empty(payload_bytes, dtype=torch.uint8, device=self.device)
        if payload_bytes:
            self._wait(dist.irecv(payload, self.peer))
        self.received_bytes += n + payload_bytes
        handoff = Handoff(manifest, payload)
        self.transfers.append(Transfer(handoff.request_id, n, payload_bytes,
                                       time.perf_counter() - t0))
        return handoff

    def _wait(self, work) -> None:
        """Wait for a receive: on CUDA first poll its completion on the host (the transfer's own
        time), then ``wait`` (the current stream waits for it, as ``dist.recv`` does)."""
        if self.device.type == "cuda":
            deadline = time.perf_counter() + POLL_LIMIT_S
            while not work.is_completed() and time.perf_counter() < deadline:
                time.sleep(POLL_S)
        work.wait()


_NOTHING = object()


class Inbox:
    """Receives from ``channel`` on a thread into a queue of ``depth`` hand-offs."""

    def __init__(self, channel: TransferChannel, depth: int = 1):
        self.channel = channel
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, name="disagg-inbox", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self.channel.device.type == "cuda":   # the CUDA device is per thread
                torch.cuda.set_device(self.channel.device)
            while True:
                handoff = self.channel.receive()
                self._queue.put(handoff)
                if handoff is None:
                    return
        except BaseException as e:   # handed to the engine's thread, which raises it
            self._queue.put(e)

    def get(self, block: bool) -> Handoff | None | object:
        """The next hand-off, None at the end of the stream, or ``Inbox.NOTHING`` when not
        ``block``ing and none has arrived."""
        try:
            item = self._queue.get(block=block)
        except queue.Empty:
            return _NOTHING
        if isinstance(item, BaseException):
            raise item
        return item

    NOTHING = _NOTHING
