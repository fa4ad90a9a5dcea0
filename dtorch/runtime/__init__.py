"""The runtime: protocol (wire format), transport (the only zmq user), controller (the asyncio
loop), worker (in-order execution), kernels and comm (what workers compute and exchange),
cluster and session (starting and supervising workers)."""
