"""A real trained model end to end: SmolLM2-135M-Instruct from its Q4_1 GGUF, against transformers
loading the same file (its own GGUF reader, dequantization and q/k un-permutation) in float32.

Measured on 2 CPU cores (torch 2.15, transformers 5.24, gguf 0.19): over every position of the
8 prompts the logits differ by at most 7e-5 (they span about +-30), and the passage's perplexity
is 25.6863 on both sides (relative difference 4e-7). The tolerances below leave room for other
BLAS builds without letting a wrong weight, a mis-ordered RoPE row or a tokenizer difference by.
"""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.models import load_model, load_tokenizer
from kvpilot.engine.scoring import EVAL_PASSAGE as PASSAGE
from kvpilot.engine.scoring import perplexity, sequence_logits
from kvpilot.kernels import cpu_int8_matmul

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

NEW_TOKENS = 64
LOGITS_ATOL = 2e-3  # largest |kvpilot - transformers| over every position and the vocabulary
PERPLEXITY_RTOL = 0.005  # the bound: within 0.5 %

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "Water boils at",
    "def fibonacci(n):\n",
    "The three primary colors are",
    "Photosynthesis is the process by which",
    "1, 2, 3, 4, 5,",
]
CHAT_PROMPT = [{"role": "user", "content": "What is the capital of France?"}]




@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def prompt_ids(hf_tokenizer) -> list[list[int]]:
    chat = hf_tokenizer.apply_chat_template(CHAT_PROMPT, tokenize=False, add_generation_prompt=True)
    return [hf_tokenizer(text).input_ids for text in [*PROMPTS, chat]]


def test_tokenizer_matches_transformers(smollm2_gguf, hf_tokenizer):
    tokenizer = load_tokenizer(smollm2_gguf)
    for text in [*PROMPTS, PASSAGE, "<|im_start|>user\nHi<|im_end|>", "naïve café 東京 🙂"]:
        assert tokenizer(text).input_ids == hf_tokenizer(text).input_ids, text
    assert tokenizer.eos_token == "<|im_end|>"


def test_chat_template_renders_like_transformers(smollm2_gguf, hf_tokenizer):
    tokenizer = load_tokenizer(smollm2_gguf)
    conversations = [
        CHAT_PROMPT,
        [{"role": "system", "content": "You answer in one word."}, *CHAT_PROMPT],
        [*CHAT_PROMPT, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Italy?"}],
    ]
    for messages in conversations:
        for add_generation_prompt in (True, False):
            ours = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            theirs = hf_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert ours == theirs
    # And it is the ChatML the model was trained on, default system prompt included.
    assert tokenizer.apply_chat_template(CHAT_PROMPT, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_logits_match_transformers(smollm2_gguf, hf_model, prompt_ids):
    model = load_model(smollm2_gguf, torch.float32, "cpu")
    worst = 0.0
    for tokens in prompt_ids:
        ours = sequence_logits(model, tokens, chunk=5)  # several chunks: cached prefix + new queries
        with torch.inference_mode():
            theirs = hf_model(torch.tensor([tokens])).logits[0].float()
        assert ours.argmax(-1).tolist() == theirs.argmax(-1).tolist()
        worst = max(worst, (ours - theirs).abs().max().item())
    print(f"largest logit difference over {len(prompt_ids)} prompts: {worst:.2e}")
    assert worst <= LOGITS_ATOL


def test_greedy_tokens_match_transformers_for_64_steps(smollm2_gguf, hf_model, prompt_ids, monkeypatch):
    # The exact route (float activations): the default rounds activations to 8 bits as llama.cpp does,
    # which keeps the perplexity (tests/quantization/test_quantized_llm.py) but not every greedy token.
    monkeypatch.setattr(cpu_int8_matmul, "load_kernel", lambda bits, group_size: None)
    # transformers generates all 8 in one left-padded batch (one prompt at a time takes minutes on
    # 2 cores); padded positions are masked out, so each row computes what it would alone.
    longest = max(len(tokens) for tokens in prompt_ids)
    pad_id = hf_model.generation_config.pad_token_id
    input_ids = torch.tensor([[pad_id] * (longest - len(t)) + t for t in prompt_ids])
    attention_mask = torch.tensor([[0] * (longest - len(t)) + [1] * len(t) for t in prompt_ids])
    with torch.inference_mode():
        out = hf_model.generate(
            input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,  # masks EOS exactly as the engine's min_tokens does
        )
    expected = out[:, longest:].tolist()
    llm = LLM(str(smollm2_gguf), dtype="float32", device="cpu", max_model_len=512, max_num_seqs=8,
              kv_cache_memory=128 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    got = [o.outputs[0].token_ids for o in llm.generate(prompt_ids, params, use_tqdm=False)]
    assert all(len(tokens) == NEW_TOKENS for tokens in expected)
    assert got == expected
    france = llm.get_tokenizer().decode(got[0])
    assert "Paris" in france, france


def test_perplexity_matches_transformers(smollm2_gguf, hf_model, hf_tokenizer):
    tokens = hf_tokenizer(PASSAGE).input_ids
    assert 250 <= len(tokens) <= 400
    model = load_model(smollm2_gguf, torch.float32, "cpu")
    ours = perplexity(sequence_logits(model, tokens, chunk=96), tokens)
    with torch.inference_mode():
        theirs = perplexity(hf_model(torch.tensor([tokens])).logits[0].float(), tokens)
    print(f"perplexity over {len(tokens)} tokens: kvpilot {ours:.6f}, transformers {theirs:.6f} "
          f"(relative difference {abs(ours / theirs - 1):.1e})")
    assert ours == pytest.approx(theirs, rel=PERPLEXITY_RTOL)
    # A trained model finds plain English predictable; random or scrambled weights score in the thousands.
    assert ours < 50
