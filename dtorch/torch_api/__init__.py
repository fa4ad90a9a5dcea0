"""torch's functions and tensor methods that are compositions of dtorch's ops, installed on
DTensor and torch's __torch_function__ dispatch."""
