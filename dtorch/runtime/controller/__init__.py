"""The controller's side of the runtime: the session, its asyncio loop and sockets, reads,
lost-worker supervision, recovery, and the pool of worker processes it starts."""
