"""A simulated LLM engine that speaks vLLM's HTTP protocol, or Triton's KServe v2 gRPC + HTTP protocol for a
TensorRT-LLM model (``--backend triton``), and costs what a GPU engine costs.

It never imports ``gateway`` or ``backends``: it is an engine, and must not be able to cheat.
"""
