"""The runtime: everything that runs processes, sockets and the event loop.

Controller side: session (the one Controller of this process; starting workers for a mesh),
controller (the asyncio loop: batching, replies, supervision hooks), cluster (worker processes and
WorkerPool: registration, heartbeats, losses), zygote (the pre-imported template local workers
fork from), reads (futures and remote failures), admission (the
run's secret, rate-limited rejection logs), rendezvous (the store collectives meet at),
gpu_assignment (which GPU each worker pins).

Host side over dtorch-launch: relay (`python -m dtorch.runtime.relay`: one subscription to the
commands per host, fanned out to that host's workers over ipc).

Both sides: protocol (the wire format; the one module that knows how messages look) and transport
(the only zmq import).

Worker side: worker_process (`python -m dtorch.runtime.worker_process`: start-up, registration,
heartbeats, exit), worker (in-order execution, one handler per command), kernels (factories and
redistribute steps), comm (the Communicator interface, shared reduce ops, Gloo), nccl (cupy NCCL),
devices (the CPU / CUDA seam), cuda (CudaDevice), host_copy (device-to-host copies for replies).
"""
