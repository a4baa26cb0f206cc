"""The simulated TensorRT-LLM model behind Triton: a request's LoRA task goes through the PEFT cache, its prompt
through the same engine as vLLM mode, and its answer comes back as the model's responses: one with the whole text,
or one per token when streaming (each holding only that token's text, as TensorRT-LLM streams)."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from loadtests.sim.engine import SimEngine
from loadtests.sim.faults import Faults
from loadtests.sim.peft_cache import LoraTask, PeftCache, PeftError
from loadtests.sim.tokenizer import tokenize
from loadtests.sim.triton_contract import GenerateRequest
from loadtests.sim.triton_errors import Kind, TritonError


@dataclass(frozen=True)
class Reply:
    """What one response holds."""

    text: str
    num_input_tokens: int
    num_output_tokens: int  # so far: cumulative when streaming
    last: bool  # the request's last data response


class TrtLlmModel:
    def __init__(self, engine: SimEngine, peft: PeftCache) -> None:
        self.engine = engine
        self.peft = peft
        self.protocols: Counter[str] = Counter()  # requests by the protocol they came over: "grpc", "http"

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[Reply, None]:
        """The request's responses. Close the iterator (``contextlib.aclosing``) to stop early: that aborts the
        engine request and releases its LoRA task."""
        # TensorRT-LLM's LlmRequest::validate, before any LoRA work: a prompt over the engine's input limit is
        # refused; a request that would run past the sequence limit is shortened (a warning there, not an error).
        # The simulated engine was built with max_seq_len = --max-model-len and max_input_len one less.
        max_seq_len = self.engine.params.max_model_len
        prompt_length = len(tokenize(request.prompt))
        if prompt_length > max_seq_len - 1:
            raise TritonError(
                f"Prompt length ({prompt_length}) exceeds maximum input length ({max_seq_len - 1}). Set log level to "
                "info and check TRTGptModel logs for how maximum input length is set"
            )
        max_tokens = min(request.max_tokens, max_seq_len - prompt_length)
        try:
            task = self.peft.acquire(request.lora_task_id, request.lora_weights, request.lora_config)
        except PeftError as exc:
            raise TritonError(str(exc), Kind.INTERNAL) from exc
        try:
            async for reply in self._run(request, max_tokens, task):
                yield reply
        finally:
            if task is not None:
                self.peft.release(task)

    async def _run(
        self, request: GenerateRequest, max_tokens: int, task: LoraTask | None
    ) -> AsyncGenerator[Reply, None]:
        sim_request = self.engine.submit(
            task.adapter if task else None,
            request.prompt,
            max_tokens,
            answer_key=f"{task.adapter}:{task.digest}" if task else None,
            stop_words=request.stop_words,
        )
        prompt_tokens, total = len(sim_request.prompt_tokens), len(sim_request.answer)
        words: list[str] = []
        try:
            while (token := await sim_request.tokens.get()) is not None:
                words.append(token)
                if request.stream:
                    piece = token if len(words) == 1 else " " + token
                    yield Reply(piece, prompt_tokens, len(words), last=len(words) == total)
        finally:
            self.engine.abort(sim_request)  # a no-op once the request has finished
        if not request.stream:
            answer = " ".join(words)
            text = answer if request.exclude_input_in_output else " ".join(filter(None, (request.prompt, answer)))
            yield Reply(text, prompt_tokens, len(words), last=True)


# What TensorRT-LLM's executor answers when a request breaks the model (its text: an internal error, not the
# request's, so a router cannot tell it from a broken replica but by where else it fails).
POISONED = "Encountered an error in forwardAsync function: the executor failed on this request"


def refuse_by_faults(faults: Faults, request: GenerateRequest) -> None:
    """The injected faults that refuse a request (either protocol): an engine error for every request, for the
    adapters named (as ``task-<lora_task_id>``, the only name the engine knows), or for a prompt (``text_input``,
    as the gateway rendered it) holding the failing marker."""
    if faults.error_status is not None:
        raise TritonError(f"Injected fault (HTTP status {faults.error_status})", Kind.UNAVAILABLE)
    adapter = None if request.lora_task_id is None else f"task-{request.lora_task_id}"
    if adapter is not None and adapter in faults.failing_adapters:
        raise TritonError(f"Injected failure of adapter {adapter}", Kind.INTERNAL)
    if faults.failing_marker is not None and faults.failing_marker in request.prompt:
        raise TritonError(POISONED, Kind.INTERNAL)
