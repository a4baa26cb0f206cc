"""Make a tiny Llama-style model, its tokenizer and LoRA adapters locally, for the real-engine test lanes.

Run with the engine venv's Python (it needs torch, transformers, tokenizers and peft; the gateway's venv has
none of them). No model hub is reachable here, so everything is made from scratch and seeded: the same command
gives the same files. The shapes follow what vLLM's CPU attention supports (head size 32).

    python tests/engines/make_tiny_model.py OUT_DIR

writes OUT_DIR/model (served as the base model) and OUT_DIR/adapters/{a1,a2,a3,a4,big-rank} (PEFT adapters;
big-rank has r=16 to test the engine's --max-lora-rank refusal). A marker file makes reruns a no-op.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VERSION = "1"
ADAPTERS = {"a1": 8, "a2": 8, "a3": 8, "a4": 8, "big-rank": 16}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "tenants call one endpoint and the gateway routes each tenant to a warm replica",
    "adapters are small low rank matrices added to the attention and mlp weights",
    "hello world, this is a tiny language model made for tests on a cpu",
] * 50


def make_tokenizer(out: Path) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def main(out_dir: str) -> None:
    out = Path(out_dir)
    marker = out / f".made-v{VERSION}"
    if marker.exists():
        print(f"tiny model already in {out}")
        return
    torch.manual_seed(0)
    model_dir = out / "model"
    tokenizer = make_tokenizer(model_dir)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    base = LlamaForCausalLM(config)
    base.save_pretrained(model_dir, safe_serialization=True)
    for index, (name, rank) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + index)
        lora = LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
        )
        peft_model = get_peft_model(LlamaForCausalLM.from_pretrained(model_dir), lora)
        with torch.no_grad():
            for param_name, param in peft_model.named_parameters():
                if "lora_" in param_name:  # B starts at zero in peft: make both non-zero so outputs change
                    param.copy_(torch.randn_like(param) * 0.5)
        peft_model.save_pretrained(out / "adapters" / name, safe_serialization=True)
    marker.write_text(json.dumps({"adapters": ADAPTERS}))
    print(f"made tiny model and {len(ADAPTERS)} adapters in {out}")


if __name__ == "__main__":
    main(sys.argv[1])
