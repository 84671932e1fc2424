"""Build a tiny random-weight Llama and its tokenizer offline, the same bytes on every run.

vLLM's CPU attention wants head_dim >= 32; /v1/chat/completions wants a chat template. The
tokenizer is a byte-level BPE trained here on a small corpus, so any text tokenizes.
"""

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CORPUS_TEXT = (
    "the proxy sends the prompt to the prefill server and the decode server . "
    "prefill computes the kv cache ; decode pulls it through mooncake and streams tokens . "
    "hello world ! how are you today ? i am fine , thank you . one two three four five six "
    "seven eight nine ten . red green blue yellow . cat dog bird fish horse . alpha beta gamma "
    "delta . user assistant system message content role reply answer question . "
)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        min_frequency=1,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [CORPUS_TEXT * 3, CORPUS_TEXT.upper(), CORPUS_TEXT.title(), "0123456789 ,;:'\"()[]{}"]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL[4:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )
    fast.save_pretrained(out)
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
        bos_token_id=bos,
        eos_token_id=tokenizer.token_to_id("</s>"),
        pad_token_id=tokenizer.token_to_id("<pad>"),
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    print(f"tiny model in {out}: vocab {len(fast)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
