"""The worker's side of the runtime: the command loop and its handlers, the kernels they run on
local shards, compiled graphs, training and file shards. Never imports the controller's side."""
