"""Build a tiny random-weight Llama and its tokenizer offline, the same bytes on every run.

vLLM's CPU attention wants head_dim >= 32; /v1/chat/completions wants a chat template. The
tokenizer is tiny_tokenizer.py's byte-level BPE, trained on a small corpus: any text tokenizes,
and the proxy's tests and fakes use the same one.
"""

import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # beside the fakes
from tiny_tokenizer import build_tokenizer


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    fast = build_tokenizer(out)  # the tokenizer the fakes and the proxy's tests use too
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=512,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    print(f"tiny model in {out}: vocab {len(fast)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
