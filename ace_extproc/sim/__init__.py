"""A simulated vLLM pod: an OpenAI-compatible server with a real block-level
prefix cache and a calibrated TTFT model, for tests, demos and benchmarks.

Run one with ``ace-extproc sim --port 8001`` or ``python -m ace_extproc.sim``;
in-process with :class:`ace_extproc.sim.app.SimServer`.
"""
