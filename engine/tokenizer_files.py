"""A real byte-level BPE tokenizer, trained locally for generated models.

The training text is built in: a few English paragraphs, lines in other scripts (accents, CJK,
emoji) so UTF-8 handling is exercised, and deterministic pseudo-English words that give the
trainer enough material for vocabularies of several thousand tokens. Rare multi-byte characters
stay split across byte tokens, which is exactly what incremental detokenization must survive.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# transformers 5 loads qwen2 folders with its Qwen2Tokenizer whatever tokenizer_config.json says; that
# class registers this token, so it must already be in the vocabulary (else len(tokenizer) > vocab).
QWEN2_UNK_TOKEN = "<|endoftext|>"
# Order fixes the ids: pad 0, bos 1, eos 2, then the chat role markers.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS, QWEN2_UNK_TOKEN)
# GPT-4/Qwen2-style pre-tokenization (letters, single digits, punctuation runs, whitespace). It is
# also exactly what Qwen2Tokenizer rebuilds, so every architecture tokenizes the same way.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# transformers renders this with jinja2; the assistant turn ends with EOS, so generation stops there.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

ENGLISH_TEXT = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Large language models predict the next token from the tokens before it. Serving them well means keeping
the accelerator busy: batches are formed every iteration, finished requests leave at once, and waiting
requests join as soon as memory allows. The key and value cache grows one block at a time, so memory is
spent only on tokens that exist.
Once upon a time there was a small village by the sea. Every morning the fishermen went out in their
boats, and every evening they came back with stories about the weather, the waves and the fish that got
away. The children listened, laughed and asked for more.
What is the capital of France? The capital of France is Paris. What is the capital of Japan? It is Tokyo.
How many days are in a week? There are seven days in a week. Water boils at one hundred degrees Celsius.
Please write a short poem about the moon. The moon is bright tonight, it shines on the hill, the river is
still, and the night is quiet and cold.
Kubernetes runs containers on a cluster of machines. An operator watches custom resources and makes the
world match what they describe. Metrics tell it how the service is doing; latency and throughput trade
against each other.
Hello! How are you today? I am fine, thank you. Can you help me with my homework? Of course, what do you
need? I need to learn about numbers: one, two, three, four, five, six, seven, eight, nine, ten, 11, 42,
100, 2024, 3.14159.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
{"name": "kvpilot", "version": 1, "tags": ["llm", "serving"]}
"""

MULTILINGUAL_TEXT = """\
Café au lait, crème brûlée, naïve façade, jalapeño, Straße, Müller, smörgåsbord, São Paulo, Kraków.
Ελληνικά γράμματα: αλφα, βήτα, γάμμα. Русский язык: привет, мир. עברית ושלום. مرحبا بالعالم.
你好，世界。今天天气很好。我们一起学习语言模型。日本語のテキスト：こんにちは、世界。한국어: 안녕하세요.
Emoji: 🙂 😀 🚀 🎉 👍 ❤️ 🌍 🤖 ✨ 🔥 — symbols: € £ ¥ © ® ™ ° ± × ÷ → ← ∑ ∞ ≈ ≠ ≤ ≥ √ π.
"""

_ONSETS = ("", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
           "z", "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr", "wh")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "y")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck", "rt", "x")


def training_corpus(num_words: int, seed: int = 0) -> list[str]:
    """Built-in text plus ``num_words`` Zipf-distributed pseudo-words, as lines."""
    rng = random.Random(seed)
    lexicon = sorted({_pseudo_word(rng) for _ in range(max(num_words // 8, 64))})
    rng.shuffle(lexicon)
    cum_weights = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(lexicon))))
    lines = ENGLISH_TEXT.splitlines() * 20 + MULTILINGUAL_TEXT.splitlines() * 4
    written = 0
    while written < num_words:
        length = rng.randint(6, 18)
        words = rng.choices(lexicon, cum_weights=cum_weights, k=length)
        sentence = " ".join(words).capitalize() + rng.choice((".", ".", ".", "?", "!", ","))
        lines.append(sentence)
        written += length
    return lines


def train_tokenizer(vocab_size: int, num_words: int, seed: int = 0):
    """A byte-level BPE ``tokenizers.Tokenizer`` that prepends BOS when encoding."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(num_words, seed), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return tokenizer


def save_tokenizer(tokenizer, out_dir: Path, model_max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template) and special_tokens_map.json."""
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    wrapped.save_pretrained(str(out_dir))
    # Keep the folder readable by transformers 4.x too: a class name both major versions know, the
    # chat template inline, and the 4.x key for extra special tokens.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    config.pop("extra_special_tokens", None)
    config["additional_special_tokens"] = list(ROLE_TOKENS)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _pseudo_word(rng: random.Random) -> str:
    syllables = rng.choices((1, 2, 3, 4), weights=(4, 5, 3, 1))[0]
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))
