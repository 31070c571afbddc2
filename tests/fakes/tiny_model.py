"""A tiny random causal LM with a real tokenizer, for fast CPU tests across the project.

`build_tiny_model(out_dir)` writes a standard Hugging Face model folder (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json) that
`AutoModelForCausalLM` / `AutoTokenizer` load like any hub model. The model is a randomly initialised 2-layer
Qwen2 (hidden 128, untied head); the tokenizer is a byte-level BPE trained here on a small built-in corpus,
with the ChatML special tokens, so `apply_chat_template` works as it does for SmolLM2-Instruct. Nothing is
downloaded.

The output is a function of `seed` alone: the same seed gives the same tokenizer and bit-identical weights.
Random weights give near-uniform next-token distributions, so generated text is noise; tests that need a
stop must pass `stop_token_ids` rather than wait for EOS.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import torch

from grpoflow.fileio import write_text_atomic

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2

# ChatML, the same template shape as SmolLM2-Instruct and Qwen2 (no default system prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

VOCAB_SIZE = 1024
HIDDEN_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
INTERMEDIATE_SIZE = 256
MAX_POSITIONS = 2048

_SENTENCES = [
    "You are a helpful assistant that replies with one bash command.",
    "List the files in the current directory, including hidden ones.",
    "Print the contents of the file named notes.txt to standard output.",
    "Count the number of lines in every python file under the src folder.",
    "Create a directory called build and change into it.",
    "Find all files larger than ten megabytes and delete them.",
    "The quick brown fox jumps over the lazy dog.",
    "Write hello world to a file called greeting.txt in the app directory.",
    "Show the last twenty lines of the server log and follow new output.",
    "Replace every tab with four spaces in main.c and save a backup.",
    "The test passes when the output file contains the expected answer.",
    "Run the unit tests and report how many of them failed.",
]
_COMMANDS = [
    "ls -la",
    "cat notes.txt",
    "wc -l src/*.py",
    "mkdir -p build && cd build",
    "echo hello world > /app/greeting.txt",
    "find . -size +10M -delete",
    "tail -n 20 -f server.log",
    "sed -i.bak 's/\\t/    /g' main.c",
    "grep -rn TODO .",
    "python3 -m pytest -q",
    "cp -r src dst",
    "chmod +x run.sh",
    "export PATH=$HOME/bin:$PATH",
    "head -c 100 /dev/urandom",
    "for f in *.txt; do echo $f; done",
    "awk '{print $1}' data.csv | sort | uniq -c",
    "tar -czf out.tar.gz out/",
]
_CODE = [
    "def add(a, b):\n    return a + b\n",
    "import os\nprint(os.listdir('.'))\n",
    "for i in range(10):\n    print(i * i)\n",
    "if __name__ == '__main__':\n    main()\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    '{"name": "task", "reward": 1.0, "passed": true}\n',
]


def _corpus() -> list[str]:
    """A few thousand lines of chat-formatted English, shell and Python: enough to learn ~1000 BPE merges."""
    lines: list[str] = []
    for sentence, command in itertools.product(_SENTENCES, _COMMANDS):
        lines.append(f"{IM_START}user\n{sentence}{IM_END}\n{IM_START}assistant\n```bash\n{command}\n```{IM_END}\n")
    lines.extend(_CODE * 20)
    lines.extend(f"{n} + {n + 1} = {2 * n + 1}; item_{n} value {n * 7 % 13}" for n in range(500))
    return lines


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = MAX_POSITIONS
    return fast


def build_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Write a random 2-layer Qwen2 and a locally trained ChatML tokenizer to `out_dir`; return `out_dir`.

    Deterministic for a given `seed` (weights and tokenizer). Takes a few seconds on one CPU core.
    """
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # BPE training is multi-threaded; one thread keeps merge order independent of scheduling.
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    tokenizer = _train_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        # Untied and a wider init than the default 0.02: with tied embeddings a random model's greedy output
        # just repeats its input token; this way greedy paths vary and top tokens have clear margins.
        tie_word_embeddings=False,
        initializer_range=0.05,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    # A private generator state: seeding the global RNG here would disturb the caller's randomness.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    write_text_atomic(out_dir / "grpoflow_tiny_model.json", json.dumps({"seed": seed}) + "\n")
    return out_dir
