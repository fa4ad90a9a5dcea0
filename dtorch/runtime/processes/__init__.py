"""The main functions of the processes a session starts besides the controller: a worker
(worker_process), the pre-imported worker template (zygote) and the per-host relays."""
