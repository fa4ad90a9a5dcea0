"""Developer tooling for the op families, kept apart so that dtorch/ops/ reads as rules: the sample
calls per op (samples), ranks simulated on this CPU (simulate), the brute-force rule checker
(`python -m dtorch.ops.tooling.validate`) and the docs/reference/ops.md generator
(`python -m dtorch.ops.tooling.docs`). The runtime never imports this package."""
