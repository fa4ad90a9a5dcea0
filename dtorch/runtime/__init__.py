"""The runtime: everything that runs processes, sockets and the event loop. Its folders are the
two processes (tests/test_layers.py holds them to it: nothing a worker runs imports controller/).

- protocol.py, transport.py: shared by both sides. protocol is the wire format, the one module that
  knows how messages look; transport is the only zmq import.
- devices/: what a worker's device is (CPU or CUDA), host copies and buffers, the communicators that
  move data between workers (Gloo, cupy NCCL), and which GPU each worker pins.
- worker/: one process per device. The command loop (worker.Worker, one handler per command), the
  kernels it runs on local shards, compiled graphs, backward and optimizer steps, file shards.
- processes/: the main functions of the processes a session starts: `python -m
  dtorch.runtime.processes.worker_process` (start-up, registration, heartbeats, exit), the zygote
  local workers fork from, and the per-host relays (`python -m dtorch.runtime.processes.relay`).
- controller/: the user's process. The session (its one Controller and worker pool), the asyncio
  loop that batches and sends commands, reads and their futures, the reply receiver, lost-worker
  supervision and recovery, the pool of worker processes (cluster), admission, interrupts.
"""
