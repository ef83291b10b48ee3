"""A tiny Llama with random weights and a byte-level BPE tokenizer trained here, saved as
a directory ``vllm serve`` loads: nothing is downloaded from a model hub.

    python make_model.py DIR

The weights come from a fixed seed and the tokenizer from a fixed corpus, so two runs
make the same model. Greedy decoding of a random model is deterministic run to run; its
tokens are meaningless, which is what a KV transfer test wants: any wrong KV changes them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: The model: small enough for three engines on two cores, shaped like a real one (GQA:
#: 4 query heads share 2 KV heads; head size 64 is one the CPU attention backend takes).
CONFIG = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float32",
)

#: Text the tokenizer learns its merges from (and prompts are drawn from).
CORPUS = [
    "the lease is renewed by heartbeats while the request waits on the decode instance",
    "a prefill instance keeps the blocks after the prompt until the reader reports done",
    "one sided reads move the key and value cache from one host to another",
    "when the decoder dies the lease expires and the blocks return to the pool",
    "a fence word tells a late reader that the block was reused for another request",
    "tokens per block differ between the two engines and the reader maps every run",
    "quick brown foxes jump over lazy dogs near the river bank in the morning light",
    "numbers such as 12 345 6789 and symbols like : ; , . ! ? appear in some prompts",
]


def make(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1234)
    config = LlamaConfig(**CONFIG)
    model = LlamaForCausalLM(config).to(torch.float32)
    # Larger logits than the default init: a clear argmax at every step, so float
    # rounding between a prefill on P and one on D does not flip a greedy token.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(out, safe_serialization=True)

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=CONFIG["vocab_size"],
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 8, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.model_max_length = CONFIG["max_position_embeddings"]
    fast.save_pretrained(out)
    # generation_config.json: vLLM reads its defaults from it; greedy unless asked.
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "do_sample": False})
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_model.py DIR")
    make(Path(sys.argv[1]))
