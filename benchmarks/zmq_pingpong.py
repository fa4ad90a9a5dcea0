"""The floor for a read: a raw pyzmq DEALER/ROUTER round trip between two processes on tcp
loopback, carrying the same payload as reading a (1,) float32 tensor."""
from __future__ import annotations

import multiprocessing

import zmq

from .timing import stopwatch

__all__ = ["round_trip_seconds", "EchoServer"]

STOP = b"stop"


def round_trip_seconds(reads: int, payload_bytes: int, timeout_s: float) -> list[float]:
    """Seconds per round trip, one sample per read, against an echo server in a child process."""
    with EchoServer(timeout_s) as server:
        return server.round_trips(reads, payload_bytes)


class EchoServer:
    """An echo server in a child process and a DEALER connected to it, kept across batches of
    round trips, so that they can take turns with other measurements (benchmark 3)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def __enter__(self) -> EchoServer:
        context = multiprocessing.get_context("spawn")
        parent_end, child_end = context.Pipe()
        self.server = context.Process(target=_echo_server, args=(child_end,), daemon=True)
        self.server.start()
        self.context = zmq.Context()
        try:
            if not parent_end.poll(self.timeout_s):
                raise TimeoutError("echo server did not report its port")
            self.dealer = self.context.socket(zmq.DEALER)
            self.dealer.setsockopt(zmq.LINGER, 0)
            self.dealer.setsockopt(zmq.RCVTIMEO, int(self.timeout_s * 1000))
            self.dealer.connect(parent_end.recv())
        except BaseException:
            self.__exit__()
            raise
        return self

    def round_trips(self, reads: int, payload_bytes: int) -> list[float]:
        """Seconds per round trip, one sample per read (one more first, untimed, warms up)."""
        payload = bytes(payload_bytes)
        return [_one_round_trip(self.dealer, payload) for _ in range(reads + 1)][1:]

    def __exit__(self, *exc) -> None:
        dealer = getattr(self, "dealer", None)
        if dealer is not None:
            try:
                dealer.send(STOP, zmq.NOBLOCK)   # a server that is gone is killed below
            except zmq.ZMQError:
                pass
            dealer.close()
        self.context.term()
        self.server.join(timeout=3)
        if self.server.is_alive():
            self.server.kill()
            self.server.join(timeout=3)


def _one_round_trip(dealer, payload: bytes) -> float:
    elapsed = stopwatch()
    dealer.send(payload)
    dealer.recv()
    return elapsed()


def _echo_server(port_pipe) -> None:
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        port_pipe.send(f"tcp://127.0.0.1:{port}")
        while True:
            identity, message = router.recv_multipart()
            if message == STOP:
                return
            router.send_multipart([identity, message])
    finally:
        router.close()
        context.term()
