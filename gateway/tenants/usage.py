"""What one request can be charged: the engine's usage report, believed up to what the request could have used.

Above that bound a report is the engine's bug (a counter gone wrong, a garbled body), not tokens anyone used, and
charging it would do lasting harm: the tenant's token bucket in a debt it could never pay off (a report of 10^15
tokens against a limit of 100,000 a minute), its traffic figure (what placement moves keys by) and its token
counters absurd. So each figure is clamped to the request's own ceiling, and every clamp is counted
(``tenantgate_usage_clamped_total{pool, replica}``, the replica that sent it) and logged.

The ceiling, per figure:
- prompt: the pool's ``context_tokens`` (an engine refuses a longer prompt); for a request of text alone, also the
  body's length in bytes plus ``PROMPT_OVERHEAD_TOKENS``: every token of a byte-level tokenizer (SentencePiece's
  byte fallback too) covers at least one byte of the text, which the JSON holds in as many bytes or more; a token
  id takes at least two (a digit and a comma); a chat template adds a preamble and a few tokens per message, fewer
  than the message's own JSON takes. Images and other parts may cost tokens their bytes do not show: context only.
- completion: ``choices`` x the request's ``max_tokens`` (its own, or the tenant's cap), none above the context.
"""

from __future__ import annotations

import logging

from gateway.observe.metrics import GatewayMetrics
from gateway.observe.telemetry import RequestRecord

log = logging.getLogger(__name__)

# What a chat template may add besides the messages' own text (a system preamble, a tool-use instruction, BOS).
PROMPT_OVERHEAD_TOKENS = 4096


def prompt_ceiling(body_bytes: int, text_only: bool, context_tokens: int) -> int:
    return min(context_tokens, body_bytes + PROMPT_OVERHEAD_TOKENS) if text_only else context_tokens


def completion_ceiling(max_tokens: int | None, choices: int, context_tokens: int) -> int:
    return choices * (context_tokens if max_tokens is None else min(max_tokens, context_tokens))


def clamp_usage(record: RequestRecord, metrics: GatewayMetrics, prompt_most: int, completion_most: int) -> int | None:
    """The tokens to charge for ``record``'s request (None when the engine did not report both figures); a figure
    above its ceiling is set to it in the record, so the token counters and the access line say what was charged."""
    prompt, completion = record.prompt_tokens, record.completion_tokens
    if (prompt is not None and prompt > prompt_most) or (completion is not None and completion > completion_most):
        log.warning(
            "replica %s of pool %s reported usage of %s prompt and %s completion tokens for a request of tenant %s "
            "that could use at most %d and %d: charged those",
            record.replica, record.pool, prompt, completion, record.tenant, prompt_most, completion_most,
        )  # fmt: skip
        metrics.usage_clamped.labels(record.pool, record.replica).inc()
        if prompt is not None:
            prompt = record.prompt_tokens = min(prompt, prompt_most)
        if completion is not None:
            completion = record.completion_tokens = min(completion, completion_most)
    return prompt + completion if prompt is not None and completion is not None else None
