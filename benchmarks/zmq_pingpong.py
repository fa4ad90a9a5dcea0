"""The floor for a read: a raw pyzmq DEALER/ROUTER round trip between two processes on tcp
loopback, carrying the same payload as reading a (1,) float32 tensor."""
from __future__ import annotations

import multiprocessing

import zmq

from .timing import stopwatch

__all__ = ["round_trip_seconds"]

STOP = b"stop"


def round_trip_seconds(reads: int, payload_bytes: int, timeout_s: float) -> list[float]:
    """Seconds per round trip, one sample per read, against an echo server in a child process."""
    context = multiprocessing.get_context("spawn")
    parent_end, child_end = context.Pipe()
    server = context.Process(target=_echo_server, args=(child_end,), daemon=True)
    server.start()
    try:
        if not parent_end.poll(timeout_s):
            raise TimeoutError("echo server did not report its port")
        return _ping(parent_end.recv(), reads, payload_bytes, timeout_s)
    finally:
        server.join(timeout=3)
        if server.is_alive():
            server.kill()
            server.join(timeout=3)


def _ping(endpoint: str, reads: int, payload_bytes: int, timeout_s: float) -> list[float]:
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    try:
        dealer.connect(endpoint)
        payload = bytes(payload_bytes)
        samples = [_one_round_trip(dealer, payload) for _ in range(reads + 1)][1:]  # first warms up
        dealer.send(STOP)
        return samples
    finally:
        dealer.close()
        context.term()


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
