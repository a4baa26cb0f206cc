"""Every default of the simulator's behaviour model, in one place, with where the figure comes from.

Times are simulated seconds; ``--time-scale`` multiplies every delay when it is slept. The figures describe a
7B base model with rank-16 LoRA adapters on one data-centre GPU, the regime docs/architecture.md's latency table names.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SimParams:
    # --- adapters -------------------------------------------------------------------------------------------
    # Reading an adapter from disk and preparing it: docs/architecture.md puts a cold load at 100 ms to over 1 s; 400 ms
    # is the middle for a rank-16 7B adapter. It grows with rank (the file and the copy grow linearly).
    cold_load_s: float = 0.400
    cold_load_reference_rank: int = 16
    # Uniform jitter of +/- this fraction on each cold load (disk and page-cache noise).
    cold_load_jitter: float = 0.25
    # Copying an adapter already in host memory into a GPU slot: tens of MB over PCIe, about 25 ms.
    swap_in_s: float = 0.025
    # vLLM's --max-loras (GPU slots) and --max-cpu-loras (host LRU); vLLM's own defaults are 1 and max_loras,
    # the simulator's are sized for a small multi-tenant fleet.
    max_loras: int = 2
    max_cpu_loras: int = 4
    max_lora_rank: int = 16

    # --- batching -------------------------------------------------------------------------------------------
    # vLLM's --max-num-seqs on a GPU defaults to 256; a smaller batch makes queueing visible in tests.
    max_num_seqs: int = 64
    # Prefill throughput of a 7B model on one GPU is roughly 10k tokens/s: 0.1 ms per uncached prompt token.
    prefill_per_token_s: float = 0.0001
    # A decode step of a 7B model at batch 1 is about 12 ms; each extra sequence adds a little, each distinct
    # adapter in the batch adds a LoRA kernel launch (Punica / S-LoRA measurements: a few ms).
    decode_step_s: float = 0.012
    decode_per_seq_s: float = 0.0002
    decode_per_adapter_s: float = 0.002

    # --- KV cache -------------------------------------------------------------------------------------------
    # vLLM's default block size is 16 tokens; 4096 blocks is 64k tokens of KV, a 7B model's share of an 80 GB GPU
    # at reduced size so that eviction is reachable in tests.
    block_size: int = 16
    kv_blocks: int = 4096
    max_model_len: int = 4096

    # --- requests -------------------------------------------------------------------------------------------
    # vLLM's default max_tokens for /v1/completions is 16.
    default_completion_max_tokens: int = 16
    # A generated answer "wants" between these many tokens before it stops by itself (finish_reason "stop").
    min_natural_tokens: int = 8
    max_natural_tokens: int = 64

    # --- clock ----------------------------------------------------------------------------------------------
    # Multiplies every simulated delay when it is slept: 0.1 runs ten times faster, 0 does not sleep at all.
    time_scale: float = 1.0
    seed: int = 0
