"""A CPU stand-in for TensorRT-LLM's `tensorrt_llm_bls` (Triton Python backend, decoupled).

Same I/O and LoRA contract as docs/triton.md, with TensorRT-LLM's error texts, so the gateway's Triton driver runs
against a real Triton server: words come from a hash of (prompt, the task's weights, seed) instead of a network.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import threading
import time
from collections import Counter, OrderedDict
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

VOCAB = (
    "the", "a", "tenant", "gateway", "routes", "adapter", "replica", "cache", "token", "stream", "engine", "model",
    "request", "answer", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "lora", "rank", "layer", "weight",
)  # fmt: skip
MAX_MODULE_ID = 21  # shared_expert_gate, the last TensorRT-LLM LoRA module (loraModule.h)
MODULE_NAMES = ("attn_qkv", "attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_4h_to_h", "mlp_gate")


class Refused(Exception):
    """A request the engine answers with an in-stream error (TensorRT-LLM's text), never a crash."""


def _optional(request: Any, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _required(request: Any, name: str) -> np.ndarray:
    array = _optional(request, name)
    if array is None:  # Triton refuses a request that lacks a required input before the model sees it
        raise Refused(f"input '{name}' is required")
    return array


def _scalar(request: Any, name: str, default: Any = None) -> Any:
    array = _optional(request, name)
    return default if array is None else array.reshape(-1)[0].item()


def _prompt(request: Any) -> str:
    prompt = _required(request, "text_input").reshape(-1)[0]
    return prompt.decode() if isinstance(prompt, bytes) else str(prompt)


def _text(value: str) -> np.ndarray:
    return np.array([[value.encode()]], dtype=object)


def _count(value: int) -> np.ndarray:
    return np.array([[value]], dtype=np.int32)


def _validate_lora(weights: np.ndarray, config: np.ndarray, max_rank: int) -> None:
    """The checks of TensorRT-LLM's loraValidateRequestTensors (runtime/loraUtils.cpp), on [1,N,W] and [1,N,3]."""
    if weights.ndim != 3:
        raise Refused("Invalid shape for lora_weights tensor")
    if config.ndim != 3:
        raise Refused("Invalid shape for lora_keys tensor")
    if weights.shape[0] != 1 or config.shape[0] != 1:
        raise Refused("Expected batch dimension to be 1 for each lora request")
    if weights.dtype != np.float16:
        raise Refused("Expected lora weights to be the same data type as base model")
    if config.shape[1] != weights.shape[1]:
        raise Refused("Expected dim1 lora_weights and lora_keys to have the same size")
    if config.shape[2] != 3:
        raise Refused("Expected dim2 of lora_keys to have a size in [3, 3]")
    for module_id, layer, rank in config[0].tolist():
        if layer < 0:
            raise Refused("Expected layerId to be in the range [0, numModelLayers)")
        if not 0 <= module_id <= MAX_MODULE_ID:
            name = MODULE_NAMES[module_id] if 0 <= module_id < len(MODULE_NAMES) else str(module_id)
            raise Refused(f"lora module {name} not enabled for this model")
        if not 1 <= rank <= max_rank:
            raise Refused(
                f"Invalid low_rank ({rank}). low_rank must be greater than 0 and less than max_low_rank ({max_rank})"
            )


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        parameters = json.loads(args["model_config"]).get("parameters", {})

        def parameter(key: str, default: str) -> str:
            return str(parameters.get(key, {}).get("string_value", default))

        self.capacity = int(parameter("lora_cache_max_adapters", "2"))
        self.max_rank = int(parameter("lora_max_rank", "8"))
        self.token_delay_s = float(parameter("token_delay_ms", "2")) / 1000
        # The engine's build limits (trtllm-build --max_input_len, --max_seq_len), in words.
        self.max_input_len = int(parameter("max_input_len", "511"))
        self.max_seq_len = int(parameter("max_seq_len", "512"))
        self.lock = threading.Lock()
        self.cache: OrderedDict[int, str] = OrderedDict()  # task id -> weights digest, least recently used first
        self.in_flight: Counter[int] = Counter()  # task id -> requests whose answer has not ended
        self.workers: set[threading.Thread] = set()

    def execute(self, requests: list[Any]) -> None:
        # Admission runs here, in arrival order, so weights sent first are cached before the next request's lookup;
        # the answer runs in a thread so that concurrent streams interleave.
        for request in requests:
            sender = request.get_response_sender()
            try:
                task, digest = self._admit(request)
            except Refused as refused:
                self._fail(sender, str(refused))
                continue
            except Exception as error:  # a malformed request gets an error response, the model goes on
                self._fail(sender, f"{type(error).__name__}: {error}")
                continue
            worker = threading.Thread(target=self._answer, args=(request, sender, task, digest), daemon=True)
            with self.lock:
                self.workers.add(worker)
            worker.start()

    def finalize(self) -> None:
        with self.lock:
            workers = list(self.workers)
        for worker in workers:
            worker.join(timeout=5)

    def _admit(self, request: Any) -> tuple[int | None, str]:
        """Check the request and its LoRA tensors; return its task (now in flight) and the digest its words use."""
        max_tokens = _scalar(request, "max_tokens")
        if max_tokens is None or max_tokens < 1:
            raise Refused(f"max_tokens must be > 0 (got {max_tokens})")
        prompt_length = len(_prompt(request).split())
        if prompt_length > self.max_input_len:  # TensorRT-LLM's LlmRequest::validate, before any LoRA work
            raise Refused(
                f"Prompt length ({prompt_length}) exceeds maximum input length ({self.max_input_len}). Set log level"
                " to info and check TRTGptModel logs for how maximum input length is set"
            )
        task = _scalar(request, "lora_task_id")
        weights, config = _optional(request, "lora_weights"), _optional(request, "lora_config")
        if weights is None and config is None:
            if task is None:
                return None, "base"
            with self.lock:
                if task not in self.cache:
                    raise Refused(f"LoRA task {task} not found in cache. Please send LoRA weights with request")
                self.cache.move_to_end(task)
                self.in_flight[task] += 1
                return task, self.cache[task]
        if task is None:
            raise Refused("lora_task_id must be set for LoRA inference")
        if weights is None or config is None:
            raise Refused("Request for LoRA inference must have both lora_weights and lora_keys")
        _validate_lora(weights, config, self.max_rank)
        digest = hashlib.sha256(weights.tobytes() + config.astype(np.int32).tobytes()).hexdigest()
        with self.lock:
            if task not in self.cache and len(self.cache) >= self.capacity:
                done = next((cached for cached in self.cache if not self.in_flight[cached]), None)
                if done is None:
                    raise Refused("PEFT Cache is full. There are no done tasks to evict")
                del self.cache[done]
            self.cache[task] = digest
            self.cache.move_to_end(task)
            self.in_flight[task] += 1
        return task, digest

    def _answer(self, request: Any, sender: Any, task: int | None, digest: str) -> None:
        try:
            self._generate(request, sender, digest)
        except Exception as error:  # the client must get a final response whatever happens
            with contextlib.suppress(Exception):  # unless it has gone (a cancelled stream refuses sends)
                self._fail(sender, f"{type(error).__name__}: {error}")
        finally:
            with self.lock:
                if task is not None:
                    self.in_flight[task] -= 1
                self.workers.discard(threading.current_thread())

    def _generate(self, request: Any, sender: Any, digest: str) -> None:
        prompt = _prompt(request)
        prompt_tokens = len(prompt.split())
        # TensorRT-LLM shortens a request that would run past the sequence limit (a warning, not an error).
        max_tokens = min(int(_scalar(request, "max_tokens")), self.max_seq_len - prompt_tokens)
        seed = _scalar(request, "seed", 0)
        stream = bool(_scalar(request, "stream", False))
        exclude_input = bool(_scalar(request, "exclude_input_in_output", False))
        stop_words = _optional(request, "stop_words")
        stops = set() if stop_words is None else {word.decode().strip() for word in stop_words.reshape(-1)}

        seed_bytes = hashlib.sha256(f"{prompt}\0{digest}\0{seed}".encode()).digest()
        rng = random.Random(seed_bytes)
        length = min(max_tokens, rng.randint(4, 24))
        tokens: list[str] = []
        for _ in range(length):
            if request.is_cancelled():
                pb_utils.Logger.log_info(f"tensorrt_llm_bls: request cancelled after {len(tokens)} tokens")
                sender.send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError("cancelled", pb_utils.TritonError.CANCELLED)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                return
            time.sleep(self.token_delay_s)
            word = rng.choice(VOCAB)
            tokens.append(" " + word)
            if stream:
                sender.send(self._response(tokens[-1], prompt_tokens, len(tokens)))
            if word in stops:  # TensorRT-LLM keeps the stop word in the output
                break
        if not stream:
            answer = "".join(tokens)
            sender.send(self._response(answer if exclude_input else prompt + answer, prompt_tokens, len(tokens)))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    @staticmethod
    def _response(text: str, input_tokens: int, output_tokens: int) -> Any:
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor("text_output", _text(text)),
                pb_utils.Tensor("num_input_tokens", _count(input_tokens)),
                pb_utils.Tensor("num_output_tokens", _count(output_tokens)),
            ]
        )

    @staticmethod
    def _fail(sender: Any, message: str) -> None:
        sender.send(
            pb_utils.InferenceResponse(error=pb_utils.TritonError(message)),
            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
        )
