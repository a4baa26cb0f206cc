"""The engines' side answers read over aiohttp (their metrics pages, vLLM's model list and runtime LoRA API), read
as text within a bound. aiohttp reads a body whole, however long: a broken engine, or anything else on its port,
that answered a probe with gigabytes would have them held in the gateway's memory, which every tenant shares."""

from __future__ import annotations

import aiohttp

from backends.http1 import MAX_WHOLE_BODY

# A metrics page is read and parsed whole on every scrape (every replica, twice a second by default), in Python: a
# 64 MiB page of blank lines froze the gateway's event loop, every tenant's requests with it, for 57-85 s a scrape
# (load average 6). A real engine's page is tens of KB, plus about 100 bytes for each label set vLLM's
# ``vllm:lora_requests_info`` ever reported: 8 MiB is some 80,000 of them. A longer page is no reading.
MAX_METRICS_PAGE = 8 * 1024 * 1024


async def read_text(response: aiohttp.ClientResponse, limit: int = MAX_WHOLE_BODY) -> str:
    """The body as text (bytes that are not UTF-8 as replacement characters: an odd byte spoils a line at most), at
    most ``limit`` bytes; a longer one raises ``aiohttp.ClientPayloadError`` (a ``ClientError``, which the drivers
    read as no answer) as soon as that shows."""
    length = response.content_length
    if length is not None and length > limit:
        raise aiohttp.ClientPayloadError(f"the engine's answer is {length} bytes, over the {limit} read")
    parts, size = [], 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise aiohttp.ClientPayloadError(f"the engine's answer is over the {limit} bytes read")
        parts.append(chunk)
    return b"".join(parts).decode("utf-8", "replace")
