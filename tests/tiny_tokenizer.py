"""A small byte-level BPE tokenizer with a chat template, trained here on a fixed corpus: the
same bytes on every run, no model hub. The fake vLLM servers tokenize with it, the proxy's
routing on KV events is tested with it, and the real-vLLM suite's tiny model
(integration/make_tiny_model.py) carries it, so every piece agrees on token ids.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

TOKENIZER_CORPUS = (
    "the proxy sends the prompt to the prefill server and the decode server . "
    "prefill computes the kv cache ; decode pulls it through mooncake and streams tokens . "
    "hello world ! how are you today ? i am fine , thank you . one two three four five six "
    "seven eight nine ten . red green blue yellow . cat dog bird fish horse . alpha beta gamma "
    "delta . user assistant system message content role reply answer question . "
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tokenizer(out: Path) -> Any:
    """Train the tokenizer and save it in ``out`` as a model's tokenizer is saved."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    transformers = importlib.import_module("transformers")

    special = [*SPECIAL_TOKENS, "<|end|>"]
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        min_frequency=1,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = TOKENIZER_CORPUS
    corpus = [text * 3, text.upper(), text.title(), "0123456789 ,;:'\"()[]{}"]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=special[4:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )
    fast.save_pretrained(out)
    return fast
