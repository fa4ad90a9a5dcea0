"""What a worker's device is: CPU or CUDA, its host copies and buffers, the communicators that move
data between workers (Gloo, NCCL), and which GPU each worker pins."""
