"""torch's functions and tensor methods that are compositions of dtorch's ops. Each module
registers what it writes in dtensor/api.py, the one table of DTensor's API: a torch function
(what __torch_function__ runs for `torch.<name>(x)`) and, where torch.Tensor has the method and
DTensor's class body does not, the method (`register_torch_spellings`). A name registered twice is
refused at import with both places named."""
