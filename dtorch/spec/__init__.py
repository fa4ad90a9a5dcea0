"""The pure core: device meshes, placements, redistribute plans and counter-based random
numbers. Imports torch only: no runtime, no sockets, no event loop."""
